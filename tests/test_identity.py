"""``datastore.readers.identity``: a copy that keeps names, sizes and times is the same data;
a rewrite of the same size, a renamed file or files in another order is not; LMDB's lock file
is no change."""

from __future__ import annotations

import os
import shutil

from datastore.readers.identity import identity


def test_a_copy_keeping_times_is_the_same_and_a_rewrite_of_the_same_size_is_not(tmp_path):
    data = tmp_path / "a" / "store"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "0.0").write_bytes(b"abcd")
    (data / "data.mdb").write_bytes(b"xy")
    first = identity([str(data)])
    (data / "lock.mdb").write_bytes(b"any reader rewrites it")
    (data / ".staging").mkdir()
    (data / ".staging" / "log").write_bytes(b"staging's own")
    assert identity([str(data)]) == first
    shutil.copytree(data, tmp_path / "b" / "store")  # copy2: the times kept
    assert identity([str(tmp_path / "b" / "store")]) == first
    st = os.stat(data / "sub" / "0.0")
    (data / "sub" / "0.0").write_bytes(b"dcba")  # the same size, rewritten a moment later
    os.utime(data / "sub" / "0.0", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert identity([str(data)]) != first
    os.utime(data / "sub" / "0.0", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert identity([str(data)]) == first  # (no byte is read)
    files = [str(data / "sub" / "0.0"), str(data / "data.mdb")]
    named = identity(files)
    os.rename(data / "data.mdb", data / "data2.mdb")  # the same bytes and time, another name
    assert identity([*files[:1], str(data / "data2.mdb")]) != named
    assert identity(files[::-1]) != identity(files)  # their samples in another order
    assert identity([]) == ""


def test_a_large_set_costs_a_bounded_number_of_stats(tmp_path, monkeypatch):
    import datastore.readers.identity as ident

    files = []
    for k in range(10):
        (tmp_path / f"{k}.npy").write_bytes(b"x")
        files.append(str(tmp_path / f"{k}.npy"))
    first = identity(files)
    taken: list[str] = []
    stat = ident._stat
    monkeypatch.setattr(ident, "_stat", lambda path: taken.append(path) or stat(path))
    monkeypatch.setattr(ident, "STATS", 4)
    sampled = identity(files)
    assert taken == [files[0], files[3], files[6], files[9]]
    assert sampled != first  # (another digest: which files it covers is part of it)
    os.utime(files[6], ns=(0, 1))
    assert identity(files) != sampled
    assert identity(files[:9]) != identity(files)  # every name counts

"""How the copy engine reaches its sources: the streams open them at the same time (on a
network filesystem every open is a round trip to the server), and a small hashed file moves
in one read and one write."""

from __future__ import annotations

import os
import threading

import staging.copy as copy
from staging.checksum import new_hasher
from staging.directio import IoPolicy
from staging.manifest import Manifest, meta_dir
from staging.plan import Group, build_plan


def _stage(src: str, dest: str, streams: int) -> copy.Stats:
    plan = build_plan([src])
    os.makedirs(os.path.join(dest, "src"), exist_ok=True)
    groups = [Group(g.source, tuple(i for i in g.items if i.kind != "dir")) for g in plan.groups]
    policy = IoPolicy("auto", meta_dir(dest), log=False)
    return copy.Engine(dest, 0, "xxh3", streams, policy).run(groups)


def test_the_streams_open_their_sources_at_the_same_time(tmp_path, monkeypatch):
    src, dest, streams = tmp_path / "src", str(tmp_path / "dest"), 4
    src.mkdir()
    for k in range(streams):
        (src / f"f{k}").write_bytes(bytes([k]) * 1000)
    # Every open waits until all the streams are opening: opens made one at a time (under
    # the engine's lock, as before) break the barrier after 10 s instead.
    together = threading.Barrier(streams, timeout=10)
    opened = copy.Engine._open_source

    def open_together(self, path, flags):
        together.wait()
        return opened(self, path, flags)

    monkeypatch.setattr(copy.Engine, "_open_source", open_together)
    stats = _stage(str(src), dest, streams)
    assert stats.errors == [] and stats.files == streams
    for k in range(streams):
        assert (tmp_path / "dest" / "src" / f"f{k}").read_bytes() == bytes([k]) * 1000
    assert len(Manifest.load(dest).entries) == streams


def test_a_small_hashed_file_moves_through_the_buffer(tmp_path, monkeypatch):
    spliced = []
    monkeypatch.setattr(copy, "splice_range", lambda *a: spliced.append(a[4]) or False)
    data = os.urandom(copy.BUFFERED_BYTES)
    (tmp_path / "src").write_bytes(data)
    want = new_hasher("xxh3")
    want.update(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        got = copy.copy_range(copy.Fd(src), copy.Fd(dst), 0, 0, len(data), "xxh3")
        assert spliced == []  # one read, the hash, one write: no kernel copy read back
        copy.copy_range(copy.Fd(src), copy.Fd(dst), 0, 0, len(data), "none")
        assert spliced == [len(data)]  # unhashed, the kernel still moves the bytes
    finally:
        os.close(src)
        os.close(dst)
    assert got == want.digest() and (tmp_path / "dst").read_bytes() == data

"""How the copy engine reaches its sources: the streams open them at the same time (on a
network filesystem every open is a round trip to the server), a small hashed file moves in
one read and one write, on a FUSE filesystem a small file is read direct, and the tar walk
waits for the read-ahead of the chunk it reads; the plan lists directories in parallel; the
committer thread is woken once per batch of finished files."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import pytest
from helpers import file_info, random_bytes, tar_bytes

import staging.copy as copy
from staging import plan as plan_mod
from staging import prefetch
from staging.archive import list_members
from staging.checksum import LEAF_BYTES, combine, new_hasher
from staging.directio import IoPolicy, fs_type
from staging.manifest import META, Journal, Manifest, meta_dir
from staging.plan import Group, build_plan


def _stage(src: str, dest: str, streams: int) -> copy.Stats:
    plan = build_plan([src])
    os.makedirs(os.path.join(dest, "src"), exist_ok=True)
    os.makedirs(meta_dir(dest), exist_ok=True)
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


def test_small_files_on_a_local_disk_are_read_through_the_page_cache(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    assert not IoPolicy("auto", str(tmp_path), log=False).reads_whole_direct(str(tmp_path / "f"))
    assert not IoPolicy("buffered", str(tmp_path), log=False).reads_whole_direct(
        str(tmp_path / "f")
    )


NETFS_MNT = os.environ.get("NETFS_MNT", "/mnt/datastore-netfs")


def _glusterfs_live(mnt: str) -> bool:
    """A GlusterFS mount that answers: a mount whose server died still lists as
    fuse.glusterfs but every call on it fails with ENOTCONN."""
    if fs_type(mnt) != "fuse.glusterfs":
        return False
    try:
        os.statvfs(mnt)
        os.listdir(mnt)
    except OSError:
        return False
    return True


@pytest.mark.skipif(
    not _glusterfs_live(NETFS_MNT),
    reason=f"no live GlusterFS mount at {NETFS_MNT} (benchmarks/netfs.sh up, as root)",
)
def test_small_files_on_a_fuse_filesystem_are_read_direct_and_staged_whole(tmp_path, monkeypatch):
    # each is opened direct, not switched to direct after the open (two system calls more)
    reads, switched = [], []
    read_at = copy.read_at
    monkeypatch.setattr(copy, "_set_direct", lambda fd: switched.append(fd) or True)
    monkeypatch.setattr(copy, "read_at", lambda *a: reads.append(a[4]) or read_at(*a))
    src = tempfile.mkdtemp(prefix="test-stage-sources-", dir=NETFS_MNT)
    try:
        files = {f"f{k}": os.urandom(5000 + k * 4096) for k in range(3)}
        for name, data in files.items():
            with open(os.path.join(src, name), "wb") as f:
                f.write(data)
        assert IoPolicy("auto", str(tmp_path), log=False).reads_whole_direct(
            os.path.join(src, "f0")
        )
        dest = str(tmp_path / "dest")
        plan = build_plan([src])
        os.makedirs(os.path.join(dest, os.path.basename(src)))
        os.makedirs(meta_dir(dest))
        groups = [
            Group(g.source, tuple(i for i in g.items if i.kind != "dir")) for g in plan.groups
        ]
        stats = copy.Engine(dest, 0, "xxh3", 2, IoPolicy("auto", meta_dir(dest), log=False)).run(
            groups
        )
        assert stats.errors == [] and stats.files == 3
        assert reads == [True, True, True] and switched == []
        for name, data in files.items():
            with open(os.path.join(dest, os.path.basename(src), name), "rb") as f:
                assert f.read() == data
    finally:
        shutil.rmtree(src)


def test_the_tar_walk_waits_for_the_read_ahead_of_its_chunk(tmp_path, monkeypatch):
    """A read into a chunk still being read ahead waits for that job instead of asking the
    filesystem for the same pages itself."""
    monkeypatch.setattr(prefetch, "CHUNK", 1 << 16)
    data = os.urandom(4 << 16)
    (tmp_path / "f").write_bytes(data)
    pull, finished = prefetch._pull, []

    def slow_pull(fd: int, null: int, offset: int, length: int) -> None:
        time.sleep(0.3)  # still running when the reader first asks for its chunk
        pull(fd, null, offset, length)
        finished.append(offset)

    monkeypatch.setattr(prefetch, "_pull", slow_pull)
    with prefetch.AheadReader(str(tmp_path / "f"), window=2 << 16, threads=2) as r:
        assert r.read(10) == data[:10]
        assert 0 in finished  # the job for chunk 0 was done before the read returned
        assert r.read() == data[10:]


def test_the_plan_lists_directories_at_the_same_time_in_the_same_order(tmp_path, monkeypatch):
    src = tmp_path / "src"
    for d in ("a", "b", "c"):
        (src / d / "sub").mkdir(parents=True)
        (src / d / "f").write_bytes(d.encode())
        (src / d / "sub" / "g").write_bytes(b"g")
    # The three sibling directories are listed together: one at a time, the barrier breaks.
    together = threading.Barrier(3, timeout=10)
    listing = plan_mod._listing

    def list_together(path: str):
        if os.path.dirname(path) == str(src):
            together.wait()
        return listing(path)

    monkeypatch.setattr(plan_mod, "_listing", list_together)
    plan = build_plan([str(src)])
    assert plan.errors == []
    assert [i.dest for i in plan.items] == [
        "src",
        *("src/a", "src/b", "src/c"),
        *("src/c/f", "src/c/sub", "src/c/sub/g"),
        *("src/b/f", "src/b/sub", "src/b/sub/g"),
        *("src/a/f", "src/a/sub", "src/a/sub/g"),
    ]


def test_the_committer_is_woken_once_per_batch_not_once_per_file(tmp_path):
    dest = str(tmp_path / "dest")
    os.makedirs(meta_dir(dest))
    journal = Journal(dest, 0)
    committer = copy.Committer(dest, journal, batch_files=10)
    handed, put = [], committer._q.put
    committer._q.put = lambda job: handed.append(job) or put(job)
    for k in range(25):
        tmp = os.path.join(meta_dir(dest), f"t{k}")
        with open(tmp, "wb") as f:
            f.write(bytes([k]))
        committer.add(tmp, f"f{k:02d}", {"entry": f"f{k:02d}", "kind": "file"}, 1)
    committer.close()
    journal.close()
    # two full batches, then close() with the last five (was: one hand-off per file)
    assert [len(b) if isinstance(b, list) else b for b in handed] == [10, 10, None]
    assert committer.errors == []
    assert sorted(os.listdir(dest)) == [META, *(f"f{k:02d}" for k in range(25))]
    assert sorted(Manifest.load(dest).entries) == [f"f{k:02d}" for k in range(25)]


def test_the_tar_walk_reads_each_header_with_one_system_call(tmp_path, monkeypatch):
    # tarfile reads the byte before each header, then the header: both from one block
    arc = tmp_path / "x.tar"
    arc.write_bytes(
        tar_bytes([(file_info(f"m{k:03d}"), random_bytes(5000, k)) for k in range(100)])
    )
    offsets, preadv = [], os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: offsets.append(a[2]) or preadv(*a))
    members = list_members(str(arc), "tar", arc.stat().st_size)
    assert [m.name for m in members] == [f"m{k:03d}" for k in range(100)]
    assert len(offsets) <= 115, len(offsets)  # was 202: two per member


def _sparse(path: str, size: int, runs: list[tuple[int, int]]) -> bytes:
    """A file of ``size`` bytes that is a hole but for random ``runs`` (offset, length)."""
    with open(path, "wb") as f:
        f.truncate(size)
        for k, (off, n) in enumerate(runs):
            f.seek(off)
            f.write(random_bytes(n, seed=k))
    with open(path, "rb") as f:
        return f.read()


def _digest(data: bytes) -> str:
    leaves = []
    for off in range(0, len(data), LEAF_BYTES):
        h = new_hasher("xxh3")
        h.update(data[off : off + LEAF_BYTES])
        leaves.append(h.digest())
    return combine("xxh3", leaves)


def test_a_sparse_file_is_staged_with_its_holes(tmp_path):
    """Like ``cp --sparse=auto``: a file with holes used to land fully allocated (a 100 MiB
    file of 4 KiB of data took 102,404 KiB of node-local disk, ``cp`` 4 KiB); its bytes and
    checksum are those of the dense file, a hole at the end included."""
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    os.mkdir(src)
    files = {
        "small": _sparse(f"{src}/small", 600_000, [(40_960, 5000)]),
        "large": _sparse(f"{src}/large", LEAF_BYTES + (8 << 20), [(1 << 20, 4096)]),
    }
    assert _stage(src, dest, 2).errors == []
    entries = Manifest.load(dest).entries
    for name, data in files.items():
        st = os.stat(f"{dest}/src/{name}")
        assert st.st_blocks <= os.stat(f"{src}/{name}").st_blocks + 8, name  # 4 KiB of slack
        with open(f"{dest}/src/{name}", "rb") as f:
            assert f.read() == data
        assert entries[f"src/{name}"]["hash"] == _digest(data)

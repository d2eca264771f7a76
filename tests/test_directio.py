"""Direct I/O: aligned reads and writes at any offset, the tar header reader, extents, fallbacks."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile

import pytest
from helpers import run_stage, tree_bytes

from staging.copy import extents
from staging.directio import (
    ALIGN,
    DirectReader,
    IoPolicy,
    aligned_buffer,
    cached,
    read_at,
    reads_direct,
    write_at,
)
from staging.plan import Item


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize(("offset", "want"), [(0, 4096), (512, 10_000), (4095, 1), (70_001, 9999)])
def test_read_at_any_offset(tmp_path, direct, offset, want):
    data = os.urandom(100_000)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        got = read_at(fd, aligned_buffer(64 * 1024), offset, want, direct)
    finally:
        os.close(fd)
    assert bytes(got) == data[offset : offset + want]


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 12_345])
def test_direct_write_pads_then_truncates(tmp_path, n):
    buf = aligned_buffer(64 * 1024)
    payload = os.urandom(n)
    buf[:n] = payload
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        write_at(fd, buf, n, 0, True)
        assert os.fstat(fd).st_size == (n + ALIGN - 1) // ALIGN * ALIGN
        os.ftruncate(fd, n)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == payload


def test_direct_reader_lists_what_tarfile_lists(tmp_path):
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i, name in enumerate(["a" * 300 + "/x", "short", "p" * 200, "d/" + "q" * 250]):
            data = os.urandom(7000 * i + 1)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    with DirectReader(str(path)) as raw, tarfile.open(fileobj=raw, mode="r:") as tf:
        ours = [(m.name, m.size, m.offset_data) for m in tf]
    with tarfile.open(path) as tf:
        assert ours == [(m.name, m.size, m.offset_data) for m in tf]


def _item(offset: int, size: int) -> Item:
    return Item(dest=f"m{offset}", kind="file", source="a.tar", ident="", size=size, offset=offset)


def test_extents_group_neighbours_within_limit():
    items = [_item(512, 1000), _item(2048, 1000), _item(3584, 5000), _item(200_000, 10)]
    runs = extents(items, limit=8000)  # 512 .. 3584+5000 would span 8072 bytes
    assert [[i.offset for i in run] for run in runs] == [[512, 2048], [3584], [200_000]]


def test_extents_cover_every_item_once():
    items = [_item(o, s) for o, s in [(512 * k * 3, 700) for k in range(100)]]
    runs = extents(items, limit=10_000)
    assert sorted(i.offset for run in runs for i in run) == sorted(i.offset for i in items)
    assert all(run[-1].offset + run[-1].size - run[0].offset <= 10_000 for run in runs)


@pytest.mark.parametrize("io_mode", ["buffered", "direct"])
def test_round_trip_in_each_io_mode(make_tree, tmp_path, io_mode):
    src = make_tree(tmp_path / "src")
    tar = tmp_path / "src.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(src, arcname="packed")
    run_stage(src, tar, "--to", tmp_path / "dest", "--io", io_mode, check=0)
    assert tree_bytes(tmp_path / "dest" / "src") == tree_bytes(src)
    assert tree_bytes(tmp_path / "dest" / "packed") == tree_bytes(src)
    run_stage("--verify", "--to", tmp_path / "dest", check=0)


def test_filesystem_without_direct_io_falls_back_and_says_so(make_tree, tmp_path):
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    # ramfs has no O_DIRECT (tmpfs has it since Linux 6.6) and reports no capacity
    mount = subprocess.run(
        ["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {mount.stderr.strip()}")
    try:
        src = make_tree(tmp_path / "src")
        proc = run_stage(src, "--to", mnt / "dest", "--io", "direct", check=0)
        assert "refuses O_DIRECT; writing through the page cache" in proc.stderr
        assert "reports no capacity; skipping the free-space check" in proc.stderr
        assert tree_bytes(mnt / "dest" / "src") == tree_bytes(src)
        proc = run_stage(src, "--to", mnt / "auto", check=0)  # auto never asks for O_DIRECT
        assert "O_DIRECT" not in proc.stderr
        assert tree_bytes(mnt / "auto" / "src") == tree_bytes(src)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _cold(path) -> None:
    """Push ``path``'s clean pages out of the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_cached_tells_a_warm_file_from_a_cold_one(tmp_path):
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT on this platform")
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * 2**20 + 123))
    _cold(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if cached(fd, size):
            pytest.skip("this filesystem keeps pages after POSIX_FADV_DONTNEED")
        policy = IoPolicy("auto", str(tmp_path), log=False)
        if not reads_direct(str(path), "auto", log=False):
            pytest.skip("this filesystem is not read direct under auto")
        assert policy.read_direct(str(path), fd, size, archive=True)  # cold: direct
        os.pread(fd, size, 0)  # now warm
        assert cached(fd, size)
        assert not policy.read_direct(str(path), fd, size, archive=True)  # warm: from memory
        assert IoPolicy("direct", str(tmp_path), log=False).read_direct(str(path), fd, size)
    finally:
        os.close(fd)
    assert not cached(-1, 0)  # an empty file: nothing to tell


def test_auto_reads_only_a_cold_archive_direct_and_writes_through_the_page_cache(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    _cold(path)
    fd, fd_dir = os.open(path, os.O_RDONLY), os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        auto = IoPolicy("auto", str(tmp_path), log=False)
        assert not auto.writes_direct()
        assert not auto.read_direct(str(path), fd, 1 << 20)  # a plain file: the kernel copies
        buffered = IoPolicy("buffered", str(tmp_path), log=False)
        assert not buffered.read_direct(str(path), fd, 1 << 20, archive=True)
        assert not buffered.writes_direct()
        if reads_direct(str(path), "direct", log=False):
            assert IoPolicy("direct", str(tmp_path), log=False, dir_fd=fd_dir).writes_direct()
    finally:
        os.close(fd)
        os.close(fd_dir)


def test_the_direct_write_probe_goes_through_the_directory_open_never_a_link(tmp_path):
    """``--io direct`` probed a write by path in ``DEST/.datastore`` on every rank: a link
    swapped in there had the probe file made and removed where it led. It is made through the
    descriptor the stage holds: here the probe's name taken where the link leads (its create
    failed there: not direct) changes nothing."""
    real, other = tmp_path / "real", tmp_path / "other"
    real.mkdir()
    (other / f".datastore-direct-probe-{os.getpid()}").mkdir(parents=True)
    (tmp_path / "meta").symlink_to(other)
    (real / "f").write_bytes(b"x")
    if not reads_direct(str(real / "f"), "direct", log=False):
        pytest.skip("this filesystem refuses O_DIRECT")
    (real / "f").unlink()
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert IoPolicy("direct", str(tmp_path / "meta"), log=False, dir_fd=fd).writes_direct()
    finally:
        os.close(fd)
    assert os.listdir(real) == [] and os.listdir(other) == [
        f".datastore-direct-probe-{os.getpid()}"
    ]


def test_a_warm_source_is_staged_exactly(make_tree, tmp_path):
    src = make_tree(tmp_path / "src")
    tree_bytes(src)  # read it all: warm
    run_stage(src, "--to", tmp_path / "dest", check=0)
    assert tree_bytes(tmp_path / "dest" / "src") == tree_bytes(src)
    run_stage("--verify", "--to", tmp_path / "dest", check=0)

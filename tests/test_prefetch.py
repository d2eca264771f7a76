"""Reading ahead (staging.prefetch): the tar header walk on a network filesystem."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from staging import prefetch
from staging.archive import list_members
from staging.directio import cached
from staging.prefetch import AheadReader


def test_ahead_reader_reads_what_the_file_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "CHUNK", 4096)  # many read-ahead jobs on a small file
    data = os.urandom(100_000)
    (tmp_path / "f").write_bytes(data)
    with AheadReader(str(tmp_path / "f"), window=16_384, threads=2) as r:
        assert r.read(10) == data[:10]
        assert r.seek(50_000) == 50_000
        assert r.read(7) == data[50_000:50_007]
        assert r.tell() == 50_007
        assert r.seek(-5, io.SEEK_END) == 99_995
        assert r.read(100) == data[-5:]
        assert r.read(1) == b""
        r.seek(1, io.SEEK_SET)
        assert r.seek(2, io.SEEK_CUR) == 3
        assert r.read() == data[3:]


def test_header_walk_brings_the_archive_into_the_page_cache(tmp_path):
    """A walk not read direct leaves every member's bytes cached for the copy that follows
    (before: only what the kernel's readahead happened to take)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"m{i:02d}").write_bytes(bytes([i]) * (3 << 20))
    tar = tmp_path / "a.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(src, arcname="src")
    fd = os.open(tar, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cached(fd, size):
            pytest.skip("this filesystem keeps the file cached (cannot start cold)")
        members = list_members(str(tar), "tar", size, direct=False)
        assert [m.name for m in members if m.kind == "file"] == [f"src/m{i:02d}" for i in range(12)]
        assert cached(fd, size)
    finally:
        os.close(fd)

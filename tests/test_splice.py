"""The kernel copy: exact bytes at any offset, across filesystems, refusals and short sources."""

from __future__ import annotations

import errno
import os

import pytest

from staging.checksum import new_hasher
from staging.copy import Fd, copy_range
from staging.splice import PIPE_BYTES, splice_range


def _files(src_path, dst_path, data: bytes) -> tuple[int, int]:
    src_path.write_bytes(data)
    return os.open(src_path, os.O_RDONLY), os.open(dst_path, os.O_RDWR | os.O_CREAT, 0o600)


@pytest.mark.parametrize(
    ("src_off", "dst_off", "length"),
    [(0, 0, 1), (0, 0, PIPE_BYTES), (4095, 1, PIPE_BYTES * 3 + 17), (123, 8192, 5_000_000)],
)
def test_splice_copies_exact_bytes_between_offsets(tmp_path, src_off, dst_off, length):
    data = os.urandom(src_off + length + 99)
    src, dst = _files(tmp_path / "src", tmp_path / "dst", data)
    try:
        assert splice_range(src, dst, src_off, dst_off, length)
    finally:
        os.close(src)
        os.close(dst)
    got = (tmp_path / "dst").read_bytes()
    assert got == bytes(dst_off) + data[src_off : src_off + length]


def test_splice_crosses_filesystems(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    data = os.urandom(3 * PIPE_BYTES + 5)
    shm = f"/dev/shm/test-splice-{os.getpid()}"
    with open(shm, "wb") as f:
        f.write(data)
    try:
        src = os.open(shm, os.O_RDONLY)
        dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            assert splice_range(src, dst, 0, 0, len(data))
        finally:
            os.close(src)
            os.close(dst)
    finally:
        os.unlink(shm)
    assert (tmp_path / "dst").read_bytes() == data


def test_a_filesystem_that_refuses_splice_says_so_before_writing(tmp_path):
    src = os.open("/proc/self/status", os.O_RDONLY)  # procfs refuses splice (EINVAL)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert not splice_range(src, dst, 0, 0, 100)
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes() == b""


def test_a_source_shorter_than_its_plan_is_an_error(tmp_path):
    src, dst = _files(tmp_path / "src", tmp_path / "dst", os.urandom(1000))
    try:
        with pytest.raises(OSError) as err:
            splice_range(src, dst, 0, 0, 5000)
    finally:
        os.close(src)
        os.close(dst)
    assert err.value.errno == errno.EIO and "ended early" in str(err.value)


def test_copy_range_hashes_what_it_copied_on_either_path(tmp_path):
    data = os.urandom(9 * (1 << 20) + 321)  # more than one 8 MiB piece
    want = new_hasher("xxh3")
    want.update(data)
    (tmp_path / "src").write_bytes(data)
    digests = []
    for direct in (False, True):  # the kernel copy, then through the buffer
        src = os.open(tmp_path / "src", os.O_RDONLY | (os.O_DIRECT if direct else 0))
        out = tmp_path / f"dst{direct}"
        dst = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            digests.append(copy_range(Fd(src, direct), Fd(dst), 0, 0, len(data), "xxh3"))
        finally:
            os.close(src)
            os.close(dst)
        assert out.read_bytes() == data
    assert digests == [want.digest(), want.digest()]

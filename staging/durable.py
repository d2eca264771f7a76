"""Durability primitives: flush a whole filesystem, start writeback early, fsync a directory.

``syncfs`` and ``sync_file_range`` are Linux calls that the ``os`` module lacks; they are
reached through libc and fall back to ``os.sync`` / a no-op where missing.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["fsync_dir", "start_writeback", "syncfs"]

_libc = ctypes.CDLL(None, use_errno=True)  # the running process already has libc loaded
_SYNC_FILE_RANGE_WRITE = 2

try:
    _syncfs = _libc.syncfs
    _syncfs.argtypes = [ctypes.c_int]
except AttributeError:  # pragma: no cover - non-Linux libc
    _syncfs = None

try:
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except AttributeError:  # pragma: no cover - non-Linux libc
    _sync_file_range = None


def syncfs(path: str) -> None:
    """Write back every dirty page and inode of the filesystem holding ``path``."""
    if _syncfs is None:  # pragma: no cover
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs failed: {os.strerror(err)}", path)
    finally:
        os.close(fd)


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages (``length`` bytes from ``offset``;
    0: to the end) now, without waiting for them."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: str) -> None:
    """Make the entries (creations, renames) of directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

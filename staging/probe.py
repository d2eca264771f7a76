"""``--dry-run``'s time estimate from a short measured read and write probe."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from staging.durable import syncfs

__all__ = ["Probe", "existing_ancestor", "measure"]

PROBE_BYTES = 64 * 1024 * 1024
PROBE_FILES = 64


class Probe:
    """Measured read and write bandwidth (bytes/s; ``None``: not measured) and the cost of
    creating one small file."""

    def __init__(self, read_bps: float | None, write_bps: float | None, per_file_s: float):
        self.read_bps, self.write_bps, self.per_file_s = read_bps, write_bps, per_file_s

    def estimate(self, nbytes: int, nfiles: int, streams: int) -> float:
        """Seconds to stage ``nbytes`` in ``nfiles`` files: the slower side, plus file costs."""
        rates = [r for r in (self.read_bps, self.write_bps) if r]
        return max((nbytes / r for r in rates), default=0.0) + nfiles * self.per_file_s / streams


def existing_ancestor(path: str) -> str:
    """``path``, or its nearest parent that is a directory (DEST before it is made)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def measure(largest_source: str | None, dest: str) -> Probe:
    """Probe reading ``largest_source`` and writing next to ``dest``; leaves nothing behind.
    The write probe takes at most half the free space there, and none where there is no room
    for it (a full disk: it is not measured, the dry run goes on)."""
    read_bps = None
    if largest_source:
        n = min(PROBE_BYTES, os.path.getsize(largest_source))
        t0 = time.perf_counter()
        with open(largest_source, "rb", buffering=0) as f:
            got = len(f.read(n))
        read_bps = got / max(time.perf_counter() - t0, 1e-6) if got else None
    where = existing_ancestor(dest)
    room = shutil.disk_usage(where).free // 2 >> 20 << 20  # whole MiB
    try:
        write_bps, per_file_s = _write_probe(where, min(PROBE_BYTES, room))
    except OSError:  # no room, or no inode, for the probe's files
        write_bps, per_file_s = None, 0.0
    return Probe(read_bps, write_bps, per_file_s)


def _write_probe(where: str, nbytes: int) -> tuple[float | None, float]:
    """Write ``nbytes`` (whole MiB; none: not measured) and ``PROBE_FILES`` small files in a
    temporary directory in ``where``: the write bandwidth and the seconds per small file."""
    block = os.urandom(1 << 20)
    write_bps = None
    with tempfile.TemporaryDirectory(prefix=".datastore-probe-", dir=where) as tmp:
        if nbytes:
            t0 = time.perf_counter()
            fd = os.open(os.path.join(tmp, "probe"), os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                for _ in range(nbytes >> 20):
                    os.write(fd, block)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            write_bps = nbytes / max(time.perf_counter() - t0, 1e-6)
        t0 = time.perf_counter()
        for i in range(PROBE_FILES):
            with open(os.path.join(tmp, f"f{i}"), "wb") as f:
                f.write(b"x")
        syncfs(tmp)
        per_file_s = (time.perf_counter() - t0) / PROBE_FILES
    return write_bps, per_file_s

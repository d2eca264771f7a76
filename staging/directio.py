"""Direct I/O: move bytes between disk and one reused buffer, bypassing the page cache.

Buffered copying makes the kernel allocate a fresh page-cache page for every 4 KiB read and
every 4 KiB written; on many nodes (and on this project's reference VM, where first touch of
memory runs below 1 GB/s) that costs more than the disk. With ``O_DIRECT`` the device reads
into and writes from the copy buffer itself. The rules: buffer address, file offset and length
aligned to ``ALIGN``; a short tail is written padded and the file truncated to its size after.

Policy (``--io``): ``direct`` reads and writes everything with ``O_DIRECT`` where the
filesystem accepts it; ``buffered`` nothing; ``auto`` copies files through the page cache, the
kernel moving the bytes (``staging.splice``) with writeback started as each piece lands, and
reads an uncompressed tar directly only when it sits on a local block-device filesystem and is
not in the page cache already (:func:`cached`: a few ``RWF_NOWAIT`` reads spread over it).
Network and parallel filesystems (Lustre, GPFS, NFS, ...) are never read direct under ``auto``:
``O_DIRECT`` there is often many times slower.

Measured on the reference VM (``benchmarks/stage.py``, medians of 5, ratio to ``cp`` with a
final ``sync``): the kernel copy beat direct I/O in every case, cold and warm, small files and
large (one 1 GiB file cold: 1.06x against 0.80x; warm: 1.06x against 0.62x). A 16 MiB write
probe had found direct writes 10 % faster, which the whole copy did not bear out, so ``auto``
no longer probes writes.
"""

from __future__ import annotations

import ctypes
import errno
import io
import mmap
import os
import sys
import threading

__all__ = [
    "ALIGN",
    "IO_MODES",
    "DirectReader",
    "IoPolicy",
    "PositionedReader",
    "aligned_buffer",
    "cached",
    "fs_type",
    "read_at",
    "reads_direct",
    "write_at",
]

ALIGN = 4096
IO_MODES = ("auto", "direct", "buffered")
LOCAL_FS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "bcachefs"}
)
_HAS_DIRECT = hasattr(os, "O_DIRECT")


def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned, writable buffer of ``nbytes`` (an anonymous mapping), touched once."""
    view = memoryview(mmap.mmap(-1, nbytes))
    for off in range(0, nbytes, mmap.PAGESIZE):  # fault every page in now, not on the hot path
        view[off] = 0
    return view


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def fs_type(path: str) -> str:
    """The filesystem type holding ``path`` (longest mount-point prefix in /proc/self/mounts)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def _accepts_direct(dir_fd: int) -> bool:
    """Whether the directory open as ``dir_fd`` takes an ``O_DIRECT`` write: a probe file made
    through it (never through a link: by path, one swapped in for it had the probe made and
    removed where it led) and removed."""
    if not _HAS_DIRECT:
        return False
    probe = f".datastore-direct-probe-{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_NOFOLLOW
    try:
        fd = os.open(probe, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        buf = aligned_buffer(ALIGN)
        os.pwrite(fd, buf, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe, dir_fd=dir_fd)


_read_lock = threading.Lock()
_read_by_dev: dict[tuple[str, int], bool] = {}


def _note(msg: str) -> None:
    print(f"datastore stage: note: {msg}", file=sys.stderr)


def reads_direct(path: str, mode: str = "auto", log: bool = True) -> bool:
    """Whether to read ``path`` with ``O_DIRECT`` under ``mode`` (decided once per device)."""
    if mode == "buffered" or not _HAS_DIRECT:
        return False
    key = (mode, os.stat(path).st_dev)
    with _read_lock:
        if key not in _read_by_dev:
            kind = fs_type(path)
            ok = mode == "direct" or kind in LOCAL_FS
            if ok:
                try:
                    os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
                except OSError:
                    ok = False
                    if log:
                        _note(f"{kind} filesystem of {path} refuses O_DIRECT; reading buffered")
            _read_by_dev[key] = ok
        return _read_by_dev[key]


_PROBE_SPOTS = 8
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def cached(fd: int, size: int) -> bool:
    """Whether the file open at ``fd`` (buffered) is in the page cache: ``RWF_NOWAIT`` reads of
    one page at :data:`_PROBE_SPOTS` places spread over it all return at once. ``False`` when
    the kernel cannot tell (no ``RWF_NOWAIT``)."""
    if not _NOWAIT or size <= 0:
        return False
    page = bytearray(ALIGN)
    spots = {min(size - 1, size * k // _PROBE_SPOTS) & ~(ALIGN - 1) for k in range(_PROBE_SPOTS)}
    try:
        for off in sorted(spots):
            want = min(ALIGN, size - off)
            if os.preadv(fd, [memoryview(page)[:want]], off, _NOWAIT) < want:
                return False
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell
        return False
    return True


class IoPolicy:
    """Decides, once per filesystem, whether reads and writes there go direct (module
    docstring); logs fallbacks. ``dir_fd``: ``dest_dir`` open, where ``direct`` probes a
    write; without it nothing is written direct."""

    def __init__(self, mode: str, dest_dir: str, log: bool = True, dir_fd: int | None = None):
        if mode not in IO_MODES:
            raise ValueError(f"--io must be one of {', '.join(IO_MODES)}, got {mode!r}")
        self.mode, self.log = mode, log
        self._fs_by_dir: dict[str, str] = {}
        self.write_direct = mode == "direct" and dir_fd is not None and _accepts_direct(dir_fd)
        if mode == "direct" and not self.write_direct and log:
            _note(f"{dest_dir}: filesystem refuses O_DIRECT; writing through the page cache")

    def writes_direct(self) -> bool:
        """Whether files are written with ``O_DIRECT`` (only under ``direct``)."""
        return self.write_direct

    def may_read_direct(self, archive: bool = False) -> bool:
        """Whether :meth:`read_direct` can say yes, decided without touching the file."""
        return self.mode == "direct" or (self.mode == "auto" and archive)

    def reads_whole_direct(self, path: str) -> bool:
        """Whether a small file ``path``, read whole in one request, is read with ``O_DIRECT``:
        under ``auto`` on a FUSE filesystem (decided once per directory). There the page cache
        costs more than it gives: a buffered read is cut into readahead-sized requests to the
        filesystem's server one after another, a direct one goes out in parallel pieces, and
        the source's pages are never cached (GlusterFS, 1,000 x 512 KiB: the process's system
        time 0.65-0.70 s against 0.91-0.98 s). ``RWF_NOWAIT`` cannot tell whether a FUSE file
        is cached, so a warm source is read from the server again."""
        if self.mode != "auto" or not _HAS_DIRECT:
            return False
        where = os.path.dirname(path)
        kind = self._fs_by_dir.get(where)
        if kind is None:
            kind = self._fs_by_dir[where] = fs_type(where)
        return kind == "fuse" or kind.startswith("fuse.")

    def read_direct(
        self, path: str, fd: int | None = None, size: int = 0, archive: bool = False
    ) -> bool:
        """Whether to read ``path`` with ``O_DIRECT``; under ``auto`` only an ``archive`` on a
        local disk that is not in the page cache (``fd``: its buffered descriptor)."""
        if self.mode == "auto" and not archive:
            return False
        if not reads_direct(path, self.mode, self.log):
            return False
        return self.mode == "direct" or fd is None or not cached(fd, size)


class PositionedReader(io.RawIOBase):
    """A seekable read-only raw file over the descriptor ``_fd`` that keeps its own position
    ``_pos`` (subclasses read there with ``pread`` and give ``readinto``; ``_end``, where
    ``SEEK_END`` counts from, is the file's size unless they say otherwise)."""

    _fd: int
    _pos: int

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence == io.SEEK_END:
            offset += self._end()
        self._pos = offset
        return offset

    def _end(self) -> int:
        return os.fstat(self._fd).st_size


class DirectReader(PositionedReader):
    """A seekable read-only file that reads ``BLOCK``-sized aligned blocks with ``O_DIRECT``.

    For walking tar headers: each header costs one small device read instead of a read plus
    readahead of member data into fresh page-cache pages that the copy never uses.
    """

    BLOCK = 4096  # one tar header is 512 bytes and never crosses a 4 KiB boundary

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self._buf = aligned_buffer(self.BLOCK)
        self._base, self._valid, self._pos = -1, 0, 0

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        """Fill ``b`` completely unless the file ends first (tarfile expects full reads)."""
        got = 0
        while got < len(b):
            if not self._base <= self._pos < self._base + self._valid:
                self._base = self._pos & ~(ALIGN - 1)
                self._valid = os.preadv(self._fd, [self._buf], self._base)
                if self._pos >= self._base + self._valid:
                    break  # end of file
            start = self._pos - self._base
            n = min(len(b) - got, self._valid - start)
            b[got : got + n] = self._buf[start : start + n]
            got += n
            self._pos += n
        return got

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def read_at(fd: int, buf: memoryview, offset: int, want: int, direct: bool) -> memoryview:
    """Read ``want`` bytes at ``offset`` into ``buf``; the bytes read, at the start of ``buf``.

    ``buf`` needs ``want + ALIGN`` bytes of room when ``direct`` (the read starts at the aligned
    offset below and the data is moved down to the start of the buffer).
    """
    if not direct:
        return buf[: os.preadv(fd, [buf[:want]], offset)]
    base = offset & ~(ALIGN - 1)
    delta = offset - base
    span = (delta + want + ALIGN - 1) & ~(ALIGN - 1)
    got = os.preadv(fd, [buf[:span]], base) - delta
    n = max(0, min(got, want))
    if delta and n:
        addr = _address(buf)
        ctypes.memmove(addr, addr + delta, n)
    return buf[:n]


def write_at(fd: int, buf: memoryview, n: int, offset: int, direct: bool) -> None:
    """Write the first ``n`` bytes of ``buf`` at ``offset``; direct writes are padded to ``ALIGN``.

    A padded tail leaves the file longer than its data: truncate it to size when done.
    """
    if direct:
        padded = (n + ALIGN - 1) & ~(ALIGN - 1)
        if padded != n:
            buf[n:padded] = bytes(padded - n)
        data, end = buf[:padded], offset + padded
    else:
        data, end = buf[:n], offset + n
    while data:
        w = os.pwrite(fd, data, end - len(data))
        if w == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        data = data[w:]

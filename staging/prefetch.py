"""Reading ahead: bring a file's bytes into the page cache before they are needed.

On a network filesystem every cache miss is a round trip to a server. The kernel reads little
ahead there (128 KiB on a FUSE mount, and ``POSIX_FADV_WILLNEED`` is capped to the same), so
a reader that seeks from header to header, as the walk over an uncompressed tar does, waits for
one round trip after another. :class:`AheadReader` keeps a few threads pulling the bytes ahead
of it into the page cache (``sendfile`` to ``/dev/null``: the pages are read, nothing is copied
to this process), so the walk finds its headers there, and the copy that follows finds the
members' bytes there too.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from staging.directio import PositionedReader

__all__ = ["AheadReader"]

CHUNK = 8 << 20
"""The bytes one read-ahead job brings in."""
WINDOW = 64 << 20
"""How far ahead of the reader's position jobs are started."""
THREADS = 8
BLOCK = 4096
"""Small reads are served from the aligned block of this size around them."""


def _budget() -> int:
    """At most this many bytes are read ahead: a quarter of the free memory, so that bytes
    read ahead are not evicted before the copy reads them."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (OSError, ValueError):
        return 1 << 30


def _pull(fd: int, null: int, offset: int, length: int) -> None:
    """Read ``length`` bytes at ``offset`` of ``fd`` into the page cache; errors are left to
    the reader that needs the bytes."""
    try:
        while length > 0:
            n = os.sendfile(null, fd, offset, length)
            if n <= 0:
                return
            offset, length = offset + n, length - n
    except OSError:
        return


class AheadReader(PositionedReader):
    """A seekable read-only file whose next :data:`WINDOW` bytes are being read into the page
    cache by :data:`THREADS` threads while it is read.

    For the header walk of an uncompressed tar on a network filesystem. 1,000 members of
    512 KiB on GlusterFS over FUSE (docs/benchmarks.md): the walk took 2.5 s, one round trip
    per header, and left the copy to read the members after it; read ahead, 0.6-0.9 s with
    the whole archive in the page cache (4 threads, 4 MiB, 32 MiB ahead: 0.8-1.5 s).
    """

    def __init__(self, path: str, window: int = WINDOW, threads: int = THREADS):
        self._fd = os.open(path, os.O_RDONLY)
        self._null = os.open(os.devnull, os.O_WRONLY)
        self._size = os.fstat(self._fd).st_size
        self._limit = min(self._size, _budget())
        self._window, self._threads = window, threads
        self._pos = 0
        self._next = 0  # the first byte no job was started for
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[int, Future] = {}  # chunk offset -> its read-ahead job, until done
        self._block = memoryview(bytearray(BLOCK))  # the block last read, at _base
        self._base, self._valid = 0, 0
        self._lock = threading.Lock()

    def _ahead(self) -> None:
        """Start jobs for the chunks up to :data:`WINDOW` past the position."""
        self._next = max(self._next, self._pos - self._pos % CHUNK)
        end = min(self._pos + self._window, self._limit)
        while self._next < end:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="ahead")
            length = min(CHUNK, self._size - self._next)
            self._jobs[self._next] = self._pool.submit(
                _pull, self._fd, self._null, self._next, length
            )
            self._next += CHUNK

    def _wait(self, end: int) -> None:
        """Wait for the read-ahead jobs of the chunks holding the position up to ``end``:
        a read of its own into a chunk still being pulled would ask the server for the same
        pages again (GlusterFS, 1,000 x 512 KiB tar: the walk took 0.8-0.95 s against a
        source floor of 0.5-0.6 s)."""
        start = self._pos - self._pos % CHUNK
        for done in [off for off in self._jobs if off < start]:
            del self._jobs[done]  # passed: never needed again
        for off in range(start, end, CHUNK):
            job = self._jobs.pop(off, None)
            if job is not None:
                job.result()

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        """Fill ``b`` completely unless the file ends first (tarfile expects full reads).

        A read of less than :data:`BLOCK` is served from the aligned block around it, kept:
        tarfile reads the byte before each header (to see that the member's data is there)
        and then the header, most often in one block, so a walk makes one system call per
        member instead of two."""
        view = memoryview(b).cast("B")
        if len(view) >= BLOCK:
            return self._read(view)
        got = 0
        while got < len(view):
            start = self._pos - self._base
            if not 0 <= start < self._valid:
                self._base = self._pos - self._pos % BLOCK
                keep, self._pos = self._pos, self._base
                self._valid = self._read(self._block)
                self._pos, start = keep, keep - self._base
                if start >= self._valid:
                    break  # end of file
            n = min(len(view) - got, self._valid - start)
            view[got : got + n] = self._block[start : start + n]
            got += n
            self._pos += n
        return got

    def _read(self, view: memoryview) -> int:
        """Read into ``view`` at the position (and past it), waiting for the read-ahead."""
        self._ahead()
        self._wait(self._pos + len(view))
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], self._pos)
            if n == 0:
                break
            got += n
            self._pos += n
        return got

    def close(self) -> None:
        if not self.closed:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            os.close(self._fd)
            os.close(self._null)
        super().close()

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

import errno
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from staging.directio import PositionedReader, aligned_buffer

__all__ = ["AheadReader", "Held", "HeldReader"]

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


HELD_CHUNK = 4 << 20
"""The bytes of one read of :class:`HeldReader`."""
HELD_WINDOW = 32 << 20
"""The most bytes :class:`HeldReader` holds: chunks read ahead and chunks with members held.
Members held and not yet on their way to release must stay well below it (two chunks less):
the walk waits for memory to read on, and only a release gives it (``staging.copy`` gathers
at most 8 MiB before handing members to its streams)."""
HELD_THREADS = 2


class Held:
    """The bytes of one archive member, held in a :class:`HeldReader`'s memory until
    :meth:`release` (which may come from any thread, once)."""

    __slots__ = ("_from", "_reader", "offset", "size")

    def __init__(self, reader: HeldReader, offset: int, size: int):
        self._reader, self.offset, self.size = reader, offset, size
        self._from = offset  # bytes before this are let go

    def views(self) -> list[memoryview]:
        """The member's bytes, one view per chunk they lie in (waits for them to be read)."""
        return self._reader._views(self.offset, self.size)

    def pieces(self) -> Iterator[memoryview]:
        """The member's bytes chunk by chunk, each chunk let go when the next is asked for:
        a member larger than the reader's memory streams through it."""
        end = self.offset + self.size
        for base in self._reader._spans(self.offset, self.size):
            start = max(self._from, base)
            (view,) = self._reader._views(start, min(end, base + self._reader._chunk) - start)
            yield view
            self._reader._pin(start, 0, -1)
            self._from = base + self._reader._chunk

    def release(self) -> None:
        """Let go of what is still held (once all is let go: nothing)."""
        end = self.offset + max(self.size, 1)
        if self._from < end:
            self._reader._pin(self._from, end - self._from, -1)
            self._from = end


class _Chunk:
    __slots__ = ("buf", "error", "got", "job")

    def __init__(self, buf: memoryview):
        self.buf, self.got, self.error, self.job = buf, -1, None, None  # got: -1 until read


class HeldReader(PositionedReader):
    """A seekable read-only file read in order, :data:`HELD_CHUNK` bytes a read, into memory
    of its own, at most :data:`HELD_WINDOW` of it at once.

    For the walk over an uncompressed tar whose members are written as it goes: the walk's
    headers and the members' bytes (:meth:`hold`) come from the same read, so each byte of
    the archive is read once, with large reads, and copied once (``direct``: read with
    ``O_DIRECT``, straight from the filesystem into this memory). A chunk is reused once the
    walk has passed it and no member held in it is left. :class:`AheadReader` instead reads
    ahead into the page cache, and the copy reads the members from there again.
    """

    def __init__(self, path: str, direct: bool = False):
        self._fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        self._size = os.fstat(self._fd).st_size
        self._chunk, self._most = HELD_CHUNK, max(2, HELD_WINDOW // HELD_CHUNK)
        self._chunks: dict[int, _Chunk] = {}  # chunk offset -> chunk, being read or read
        self._pins: dict[int, int] = {}  # chunk offset -> members held in it
        self._free: list[memoryview] = []
        self._made = 0
        self._next = 0  # the first chunk not read yet
        self._pos = 0
        self._pool: ThreadPoolExecutor | None = None
        self._cond = threading.Condition()
        self._shut = False

    def hold(self, offset: int, size: int) -> Held:
        """Keep the ``size`` bytes at ``offset`` (ahead of the walk) until released."""
        self._pin(offset, size, 1)
        return Held(self, offset, size)

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        """Fill ``b`` completely unless the file ends first (tarfile expects full reads)."""
        view = memoryview(b).cast("B")
        got = 0
        while got < len(view) and self._pos < self._size:
            base = self._pos - self._pos % self._chunk
            chunk = self._wait(base, walk=True)
            start = self._pos - base
            n = min(len(view) - got, chunk.got - start)
            if n <= 0:
                break  # the file was cut while read
            view[got : got + n] = chunk.buf[start : start + n]
            got += n
            self._pos += n
        return got

    def _end(self) -> int:
        return self._size

    # -- chunks -----------------------------------------------------------------------------
    def _spans(self, offset: int, size: int) -> range:
        return range(offset - offset % self._chunk, offset + max(size, 1), self._chunk)

    def _pin(self, offset: int, size: int, delta: int) -> None:
        with self._cond:
            for base in self._spans(offset, size):
                self._pins[base] = self._pins.get(base, 0) + delta
                if not self._pins[base]:
                    del self._pins[base]
            if delta < 0:
                self._recycle()

    def _views(self, offset: int, size: int) -> list[memoryview]:
        views = []
        for base in self._spans(offset, size):
            chunk = self._wait(base)
            lo, hi = max(offset, base) - base, min(offset + size, base + self._chunk) - base
            if hi > chunk.got:
                raise OSError(errno.EIO, "archive ended early (changed while staging?)")
            views.append(chunk.buf[lo:hi])
        return views

    def _wait(self, base: int, walk: bool = False) -> _Chunk:
        """The chunk at ``base``, read; ``walk``: the walk is there (chunks before it that
        hold no member are reused, and reading goes on up to the window)."""
        with self._cond:
            if walk:
                self._recycle()
                if base > self._next and not any(self._next <= b < base for b in self._pins):
                    self._next = base  # the walk skipped what nobody holds: not read
            while True:
                chunk = self._chunks.get(base)
                if base >= self._size:  # a member said to run past the archive's end
                    raise OSError(errno.EIO, "archive ended early (changed while staging?)")
                if chunk is None and (base < self._next or self._shut):
                    raise OSError(errno.EIO, f"archive bytes at {base} no longer held")
                if chunk is not None and chunk.got >= 0:
                    break
                if chunk is not None and chunk.error is not None:
                    raise chunk.error
                if chunk is not None and chunk.job is not None and chunk.job.cancelled():
                    raise OSError(errno.EIO, f"archive bytes at {base} not read (closed)")
                self._fill()
                self._cond.wait()
        return chunk

    def _fill(self) -> None:
        """Start reading the next chunks while there is memory for them (lock held)."""
        while not self._shut and self._next < self._size:
            if self._free:
                buf = self._free.pop()
            elif self._made < self._most:
                buf, self._made = aligned_buffer(self._chunk), self._made + 1
            else:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(HELD_THREADS, thread_name_prefix="held")
            chunk = self._chunks[self._next] = _Chunk(buf)
            chunk.job = self._pool.submit(self._read, self._next, chunk)
            self._next += self._chunk

    def _recycle(self) -> None:
        """Reuse the chunks the walk has passed that are read and hold no member (lock held).
        The byte before the position counts as not passed: tarfile reads it before each
        header, after a member of no data one byte back."""
        last = max(self._pos - 1, 0)
        passed = last - last % self._chunk
        for base in [b for b, c in self._chunks.items() if b < passed and c.got >= 0]:
            if base not in self._pins:
                self._free.append(self._chunks.pop(base).buf)
        self._fill()

    def _read(self, base: int, chunk: _Chunk) -> None:
        want = min(self._chunk, self._size - base)
        got = 0
        try:
            while got < want:
                n = os.preadv(self._fd, [chunk.buf[got : self._chunk]], base + got)
                if n == 0:
                    break
                got += n
        except OSError as exc:
            chunk.error = exc
        with self._cond:
            if chunk.error is None:
                chunk.got = min(got, want)
            self._recycle()
            self._cond.notify_all()

    def close(self) -> None:
        """Stop reading ahead; members held stay readable where their chunks were read."""
        if not self.closed:
            with self._cond:
                self._shut = True
                for base, chunk in self._chunks.items():
                    if base not in self._pins and chunk.job is not None:
                        chunk.job.cancel()
                self._cond.notify_all()  # members waiting for chunks never to be read
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            os.close(self._fd)
        super().close()

"""The copy engine: parallel, checksummed, atomic and resumable.

Every file is written under ``DEST/.datastore/tmp/`` while its bytes are hashed, leaf by leaf
(``staging.checksum``). Bytes move through one reused buffer per thread, with direct I/O where
``staging.directio`` allows it. Files larger than one leaf are copied leaf-parallel with
``pread`` / ``pwrite``; each finished leaf is recorded in a side journal so that a copy killed
half-way keeps the leaves that still hash right. A committer thread makes finished files durable in
batches (one ``syncfs`` for many files, writeback started as each file closes), then renames
them to their final names and journals them in the manifest: nothing appears under its final
name before it is complete, on disk and checksummed.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import hashlib
import os
import queue
import shutil
import stat
import tarfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from staging.archive import DECODE_ERRORS, normalize_name, open_stream
from staging.checksum import LEAF_BYTES, combine, leaf_ranges, new_hasher
from staging.confine import beneath, opened_path
from staging.directio import ALIGN, IoPolicy, aligned_buffer, read_at, write_at
from staging.durable import start_writeback, syncfs
from staging.manifest import Journal, meta_dir, open_meta
from staging.plan import Group, Item
from staging.prefetch import Held
from staging.splice import splice_range

__all__ = [
    "Engine",
    "Stats",
    "fd_path",
    "hash_range",
    "mode_mask",
    "open_beneath",
    "opened_beneath",
    "settle_dirs",
    "tmp_dir",
    "tmp_subdir",
]

BUF_BYTES = 8 * 1024 * 1024
BUFFERED_BYTES = 1024 * 1024
"""A hashed copy up to this size goes through the buffer: one read, the hash, one write."""
EXTENT_GAP = 64 * 1024  # tar members closer than this are read together
_local = threading.local()


def tmp_dir(dest: str) -> str:
    return os.path.join(meta_dir(dest), "tmp")


def tmp_subdir(key: str) -> str:
    """The subdirectory of ``tmp/`` that holds the temp files of ``key``: its first hex digit
    (older versions used none, then the first two; ``tmpspace.clean_tmp`` moves their partial
    copies here)."""
    return key[:1]


def _grown(name: str, need: int) -> memoryview:
    """This thread's reusable buffer ``name`` with room for ``need`` bytes.

    Buffers grow (doubling, up to one I/O of ``BUF_BYTES`` plus alignment slack) to what the
    copies need: fresh memory is far dearer than reused memory, so a tree of small files
    never pays for touching a large buffer in every stream.
    """
    buf = getattr(_local, name, None)
    if buf is None or len(buf) < need:
        size = min(max(need, 2 * len(buf) if buf is not None else 0), BUF_BYTES + 2 * ALIGN)
        buf = aligned_buffer((max(size, need) + ALIGN - 1) & ~(ALIGN - 1))
        setattr(_local, name, buf)
    return buf


def _buffer(nbytes: int = BUF_BYTES) -> memoryview:
    """The copy buffer, with room for an I/O of ``nbytes`` at an unaligned offset."""
    return _grown("buf", min(nbytes, BUF_BYTES) + 2 * ALIGN)


def _tail_buffer(nbytes: int) -> memoryview:
    """The second buffer, for bytes that must move to an aligned address."""
    return _grown("tail", nbytes + ALIGN)


def extents(items: list[Item], limit: int = BUF_BYTES) -> list[list[Item]]:
    """Runs of items of one source file, by offset, close enough to be read as one extent.

    A run spans at most ``limit`` bytes (first byte to last) and its items are at most
    ``EXTENT_GAP`` apart: the members of an uncompressed tar, read with one large I/O.
    """
    runs: list[list[Item]] = []
    for item in sorted(items, key=lambda i: i.offset):
        if runs and _joins(runs[-1], item, limit):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _joins(run: list[Item], item: Item, limit: int = BUF_BYTES) -> bool:
    """Whether ``item``, next by offset, extends the extent ``run`` (see :func:`extents`)."""
    return (
        item.path == run[0].path
        and item.offset - (run[-1].offset + run[-1].size) <= EXTENT_GAP
        and item.offset + item.size - run[0].offset <= limit
    )


_BENEATH = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_beneath(dest: str, rel: str, make: bool = False, made: list[str] | None = None) -> int:
    """An ``O_PATH`` descriptor of the directory ``rel`` of ``dest``, opened a name at a time
    from ``dest``, never through a symlink: one swapped in while a stage runs is ``EPERM``
    (checked once by path, a link swapped for a directory that already held files sent the
    rest of them wherever it pointed). ``make``: missing directories are made, as
    ``os.makedirs``, and the DEST names of those it made appended to ``made``, shallowest
    first. The caller closes it.

    Raises:
        OSError: ``EPERM`` for a symlink or ``..`` on the way, else as ``openat``/``mkdirat``.
    """
    fd = os.open(dest, _BENEATH & ~os.O_NOFOLLOW)
    names = [n for n in rel.split("/") if n not in ("", ".")]
    for k, name in enumerate(names):
        fd, new = _step(fd, name, make)
        if new and made is not None:
            made.append("/".join(names[: k + 1]))
    return fd


@contextlib.contextmanager
def opened_beneath(dest: str, rel: str) -> Iterator[int]:
    """:func:`open_beneath` (nothing made) as a context: the descriptor is closed on leaving."""
    fd = open_beneath(dest, rel)
    try:
        yield fd
    finally:
        os.close(fd)


def _step(fd: int, name: str, make: bool) -> tuple[int, bool]:
    """The directory ``name`` in directory ``fd``, as :func:`open_beneath` opens it, and
    whether it was made; ``fd`` is closed, whatever happens."""
    try:
        if name == "..":
            raise OSError(errno.EPERM, "refusing to write through '..'", name)
        try:
            return os.open(name, _BENEATH, dir_fd=fd), False
        except FileNotFoundError:
            if not make:
                raise
            try:
                os.mkdir(name, dir_fd=fd)
            except FileExistsError:
                return os.open(name, _BENEATH, dir_fd=fd), False
            return os.open(name, _BENEATH, dir_fd=fd), True
        except NotADirectoryError:
            if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise OSError(errno.EPERM, "refusing to write through a symlink", name) from None
            raise
    finally:
        os.close(fd)


def fd_path(fd: int, name: str = "") -> str:
    """A path to ``name`` in the directory open as ``fd`` (``/proc/self/fd``: no link between
    them is followed again); the file open as ``fd`` itself without ``name``."""
    path = f"/proc/self/fd/{fd}"
    return os.path.join(path, name) if name else path


def mode_mask(special_bits: bool) -> int:
    """The permission bits written to DEST: setuid, setgid and sticky only when asked for."""
    return 0o7777 if special_bits else 0o777


def settle_dirs(dest: str, dirs: list[Item], special_bits: bool) -> list[str]:
    """Give the directories ``dirs`` of a plan, once everything is placed in them, their
    modes and then their modification times, deepest first (placing an entry, or a mode
    without the owner's rights, in a directory would undo or stop its parent's); of two
    items of one directory the later wins, as with ``tar -xf``. Returns the errors."""
    last = {i.dest: i for i in dirs}
    errors = []
    for item in sorted(last.values(), key=lambda i: -i.dest.count("/")):
        try:
            fd = open_beneath(dest, item.dest)  # (a link swapped in: its target's mode stays)
            try:
                os.chmod(fd_path(fd), item.mode & mode_mask(special_bits))
                if item.mtime_ns:
                    os.utime(fd_path(fd), ns=(item.mtime_ns, item.mtime_ns))
            finally:
                os.close(fd)
        except OSError as exc:
            errors.append(
                f"{item.source}: cannot set the mode and time of {item.dest}: {exc.strerror}"
            )
    return errors


@dataclass(frozen=True)
class Fd:
    """An open file and whether it was opened with ``O_DIRECT``."""

    fd: int
    direct: bool = False


def copy_range(
    src: Fd,
    dst: Fd,
    src_off: int,
    dst_off: int,
    length: int,
    algo: str,
    write_lock: threading.Lock | None = None,
    stop: threading.Event | None = None,
    holes: bool = False,
) -> bytes:
    """Copy ``length`` bytes between files and return their digest (``b""`` if none);
    ``write_lock``: held while writing ``dst`` in the kernel (``staging.splice.splice_range``);
    ``stop``: once set, raise :class:`Stopped` before the next piece; ``holes``: the range of
    ``dst`` reads as zeros already (a new file at its size), so a hole of ``src`` is hashed as
    the zeros it reads as and not written (``cp --sparse=auto``).

    Between two buffered descriptors the kernel moves the bytes (``staging.splice``) and the
    digest is taken of what landed in the destination (read back from its page cache, so
    ``dst`` must be readable). Otherwise, or where ``splice`` is refused, the bytes pass once
    through this thread's buffer and are hashed on the way; ``dst_off`` must then be
    ``ALIGN``-aligned when ``dst`` is direct.
    """
    h = new_hasher(algo) if algo != "none" else None
    kernel = not (src.direct or dst.direct) and (h is None or length > BUFFERED_BYTES)
    buf = _buffer(length)
    done = 0
    while done < length:  # in pieces: the disk writes one while the next is copied
        _check(stop)
        want = min(BUF_BYTES, length - done)
        s_off, d_off = src_off + done, dst_off + done
        if holes:
            gap, run = _sparse_at(src.fd, s_off, length - done)
            if gap:
                if h is not None:
                    _hash_zeros(h, gap)
                done += gap
                continue
            want = min(want, run)
        kernel = kernel and splice_range(src.fd, dst.fd, s_off, d_off, want, write_lock)
        if kernel:
            data = read_at(dst.fd, buf, d_off, want, False) if h is not None else b""
        else:
            data = read_at(src.fd, buf, s_off, want, src.direct)
            if len(data) < want:
                raise OSError(
                    errno.EIO,
                    f"source ended {length - done - len(data)} bytes early "
                    "(changed while staging?)",
                )
            write_at(dst.fd, buf, want, d_off, dst.direct)
        if h is not None:
            h.update(data)
        if not dst.direct:
            start_writeback(dst.fd, d_off, want)
        done += want
    return h.digest() if h is not None else b""


def _sparse_at(fd: int, off: int, left: int) -> tuple[int, int]:
    """The bytes of hole at ``off`` in ``fd`` and of data after them, of the next ``left``."""
    try:
        data = os.lseek(fd, off, os.SEEK_DATA)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # no holes known here: all data
            return 0, left
        if exc.errno != errno.ENXIO:  # (ENXIO: only a hole to the end)
            raise
        return left, 0
    gap = min(data - off, left)
    return gap, min(os.lseek(fd, data, os.SEEK_HOLE) - data, left - gap)


_ZEROS = bytes(1 << 20)


def _hash_zeros(h: Any, n: int) -> None:
    """Feed ``n`` zero bytes to the hasher ``h``."""
    view = memoryview(_ZEROS)
    while n:
        step = min(n, len(_ZEROS))
        h.update(view[:step])
        n -= step


class Stopped(Exception):
    """A copy given up half-way because the run is being interrupted (Ctrl-C)."""


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise Stopped


def _set_direct(fd: int) -> bool:
    """Switch ``fd`` to ``O_DIRECT``; ``False`` where its filesystem refuses."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


@dataclass
class Stats:
    """What one rank did; summed over ranks for the summary."""

    files: int = 0
    bytes: int = 0
    skipped: int = 0
    skipped_bytes: int = 0
    resumed_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: Stats) -> None:
        self.files += other.files
        self.bytes += other.bytes
        self.skipped += other.skipped
        self.skipped_bytes += other.skipped_bytes
        self.resumed_bytes += other.resumed_bytes
        self.errors.extend(other.errors)


Batch = list[tuple[str, str, dict[str, Any], int]]
"""Finished temp files: (temp path, DEST-relative name, manifest record, bytes)."""


class Committer:
    """Makes finished temp files durable in batches, renames them, and journals them.

    Finished files gather in a batch that its thread takes when it is full (``batch_bytes`` or
    ``batch_files``), on :meth:`drain` and :meth:`close`, and once a second whatever there is:
    the thread is woken once per batch, not once per file (a thread hand-off per file)."""

    def __init__(
        self, dest: str, journal: Journal, batch_bytes: int = 256 << 20, batch_files: int = 1024
    ):
        self.dest, self.journal = dest, journal
        self.batch_bytes, self.batch_files = batch_bytes, batch_files
        self._q: queue.Queue[Batch | threading.Event | None] = queue.Queue()
        self._lock = threading.Lock()
        self._batch: Batch = []
        self._pending = 0  # bytes in _batch
        self.errors: list[str] = []
        self.placed = Stats()  # the files and bytes placed under their names
        self._thread = threading.Thread(target=self._loop, name="committer", daemon=True)
        self._thread.start()

    def add(self, tmp: str, dest_rel: str, record: dict[str, Any], nbytes: int) -> None:
        with self._lock:
            self._batch.append((tmp, dest_rel, record, nbytes))
            self._pending += nbytes
            if self._pending < self.batch_bytes and len(self._batch) < self.batch_files:
                return
        self._q.put(self._take())

    def drain(self) -> None:
        """Block until everything added so far is durable under its final name."""
        ev = threading.Event()
        self._q.put(ev)
        ev.wait()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _take(self) -> Batch:
        with self._lock:
            batch, self._batch, self._pending = self._batch, [], 0
        return batch

    def _loop(self) -> None:
        while True:
            try:
                job = self._q.get(timeout=1.0)
            except queue.Empty:
                job = []  # a second without a full batch: commit what there is
            if isinstance(job, list):
                self._flush_or_record(job or self._take())
                continue
            self._flush_or_record(self._take())
            if job is None:
                return
            job.set()

    def _flush_or_record(self, batch: Batch) -> None:
        try:
            self._flush(batch)
        except Exception as exc:  # a dead committer thread would leave drain() waiting for ever
            self.errors.append(f"committing {len(batch)} file(s) failed: {exc}")
            for tmp, *_ in batch:
                _unlink(tmp)

    def _flush(self, batch: Batch) -> None:
        if not batch:
            return
        try:
            syncfs(self.dest)  # every temp file of the batch is now on disk
        except OSError as exc:  # durability unknown: place none of them, and say so
            why = exc.strerror or str(exc)
            for tmp, rel, rec, _ in batch:
                self.errors.append(f"{rec['source']}: cannot make {rel} durable: {why}")
                _unlink(tmp)
            return
        parents: dict[str, int] = {}  # this batch's directories, opened beneath DEST
        try:
            self._place_batch(batch, parents)
        finally:
            for fd in parents.values():
                os.close(fd)

    def _place_batch(self, batch: Batch, parents: dict[str, int]) -> None:
        placed = []
        for tmp, rel, rec, nbytes in batch:
            parent, name = os.path.split(rel)
            try:
                if parent not in parents:
                    parents[parent] = open_beneath(self.dest, parent, make=True)
                _place(tmp, parents[parent], name)
            except OSError as exc:
                self.errors.append(f"{rec['source']}: cannot place at {rel}: {exc.strerror}")
                _unlink(tmp)
                continue
            self.journal.write(rec)
            placed.append((rel, rec, nbytes))
        try:
            self.journal.flush()
        except OSError as exc:  # unrecorded, a file is unknown to re-runs, --verify and shards
            for rel, rec, _ in placed:
                self.errors.append(f"{rec['source']}: cannot record {rel}: {exc.strerror}")
                parent, name = os.path.split(rel)
                _unlink(fd_path(parents[parent], name))
            return
        self.placed.files += len(placed)
        self.placed.bytes += sum(nbytes for *_, nbytes in placed)


def _unchanged(item: Item, st: os.stat_result) -> None:
    """Raise ``OSError`` when the source file of ``item`` is no longer as the plan found it
    (written to while it was copied): its copy may hold parts of two states, recorded as the
    first. Archive members are not checked."""
    now = f"{st.st_size}:{st.st_mtime_ns}"
    if item.path == item.source and now != item.ident:
        why = f"changed while being copied (size:mtime_ns {item.ident}, then {now}); not placed"
        raise OSError(errno.EAGAIN, why)


def _place(tmp: str, parent: int, name: str) -> None:
    """``os.replace`` to ``name`` in the directory ``parent``, also over a directory that
    holds only directories: one an earlier run made where the source has a file now (an empty
    directory of the source, whose name is a file's now, as ``rsync`` replaces it). A
    directory holding anything else stays, the error raised. Each is removed through its
    parent opened beneath ``parent`` (by path, one of the tree swapped for a link once
    checked had the empty directory it led to removed)."""
    try:
        os.replace(tmp, name, dst_dir_fd=parent)
    except IsADirectoryError:
        tree = _dirs_only(fd_path(parent), name)
        if tree is None:
            raise
        for rel in tree:
            head, tail = os.path.split(rel)
            with opened_beneath(fd_path(parent), head) as fd:
                os.rmdir(tail, dir_fd=fd)
        os.replace(tmp, name, dst_dir_fd=parent)


def _dirs_only(top: str, name: str) -> list[str] | None:
    """The directories of the tree ``name`` of directory ``top``, by their names in ``top``,
    deepest first, when it holds nothing else."""
    found = []
    for root, dirs, files in os.walk(os.path.join(top, name), topdown=False):  # no link followed
        if files or any(os.path.islink(os.path.join(root, d)) for d in dirs):
            return None
        found.append(os.path.relpath(root, top))
    return found


def _open_temp(path: str, flags: int) -> int:
    """``os.open`` of the temp file ``path`` (mode 600 where made), never through a link at
    its name: one planted there is ``EPERM`` (followed, the file it led to was truncated and
    written, and the link placed in DEST). A partial copy is still opened as it is."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise OSError(errno.EPERM, "refusing to write through a symlink", path) from None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _discard(outs: list[tuple[str, Fd]]) -> None:
    """Close and remove unfinished temp files."""
    for tmp, out in outs:
        os.close(out.fd)
        _unlink(tmp)


class _LeafLog:
    """Side journal of the leaves of one large temp file: ``ident`` line, then ``index digest``."""

    def __init__(self, path: str, ident: str):
        self.path, self.ident = path, ident
        self.known: dict[int, bytes] = {}
        lines: list[str] = []
        with contextlib.suppress(FileNotFoundError), open(path, opener=_open_temp) as f:
            lines = f.read().splitlines()
        if lines and lines[0] == ident:
            for line in lines[1:]:
                parts = line.split()
                if len(parts) == 2 and parts[0].isdigit():
                    self.known[int(parts[0])] = bytes.fromhex(parts[1])
        self._lock = threading.Lock()
        self._f = open(path, "w", opener=_open_temp)  # noqa: SIM115 - closed in close()
        self._f.write(ident + "\n")
        for i, d in self.known.items():
            self._f.write(f"{i} {d.hex()}\n")
        self._f.flush()

    def record(self, index: int, digest: bytes) -> None:
        with self._lock:
            self._f.write(f"{index} {digest.hex()}\n")
            self._f.flush()

    def close(self) -> None:
        self._f.close()


class Engine:
    """Copies the groups of one rank into DEST with ``streams`` parallel I/O streams."""

    def __init__(
        self,
        dest: str,
        rank: int,
        algo: str,
        streams: int,
        policy: IoPolicy,
        on_bytes: Callable[[int], None] = lambda n: None,
        special_bits: bool = False,
        confine: tuple[str, ...] = (),
        meta: int | None = None,
    ):
        self.dest, self.algo, self.streams, self.policy = dest, algo, streams, policy
        # DEST's .datastore (the caller's descriptor, else opened here): the journal and the
        # temp files go there, never through a link swapped in for it
        self._meta = os.dup(meta) if meta is not None else open_meta(dest)
        self.mode_mask = mode_mask(special_bits)
        self.confine = confine
        self.on_bytes = on_bytes
        self.rank = rank
        self.stats = Stats()
        self._lock = threading.Lock()
        self._tmp_dirs: dict[str, int] = {}  # tmp/ ("") and its subdirectories, by name
        _spread_subdirs(fd_path(self._tmp_dir()))
        self._sources: dict[str, list] = {}  # path -> [Fd, users]
        self._direct_from_512 = True  # direct writes from 512-aligned addresses (tar data)
        self._archives: set[str] = set()  # uncompressed tars: read direct when cold (auto)
        # written ahead of the plan (ahead, settle): the run being gathered, the jobs, room
        # left on DEST for them, and each finished member's temp file and digest
        self._pending: list[Item] = []
        self._pending_held: list[Held | None] = []
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._ahead_seen: set[Item] = set()
        self._room: int | None = None
        self._held: dict[Item, tuple[str, str | None]] = {}
        self._stop = threading.Event()  # set on Ctrl-C: the copies give up at their next piece

    # -- bookkeeping -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _source(self, path: str, whole: bool = False) -> Iterator[Fd]:
        """A read descriptor of ``path``, shared by the jobs reading it at the same time
        (``pread`` is thread-safe) and closed by the last: open files stay bounded by the
        streams, not by the size of the tree. It is opened and closed outside the engine's
        lock: on a network filesystem each is a round trip to the server, which the streams
        took one at a time while the lock covered them. ``whole``: the job reads the whole
        (small) file in one request (``IoPolicy.reads_whole_direct``)."""
        with self._lock:
            entry = self._sources.get(path)
            if entry is not None:
                entry[1] += 1
        if entry is None:
            mine: Fd | None = self._open_read(path, whole)
            with self._lock:
                entry = self._sources.get(path)
                if entry is None:
                    entry, mine = self._sources.setdefault(path, [mine, 0]), None
                entry[1] += 1
            if mine is not None:  # another job opened it meanwhile: share theirs
                os.close(mine.fd)
        try:
            yield entry[0]
        finally:
            with self._lock:
                entry[1] -= 1
                last = entry[1] == 0
                if last:
                    del self._sources[path]
            if last:
                os.close(entry[0].fd)

    def _open_read(self, path: str, whole: bool = False) -> Fd:
        """``path`` opened to read, direct where the I/O policy says (not shared yet: safe to
        switch). A small file read whole direct is opened direct: two system calls fewer per
        file than switching it after the open."""
        if whole and self.algo != "none" and self.policy.reads_whole_direct(path):
            try:
                return Fd(self._open_source(path, os.O_RDONLY | os.O_DIRECT), True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        fd = self._open_source(path, os.O_RDONLY)
        try:
            archive = path in self._archives
            direct = (
                self.algo != "none"
                and self.policy.may_read_direct(archive)
                and self.policy.read_direct(path, fd, os.fstat(fd).st_size, archive)
            )
            direct = direct and _set_direct(fd)
        except BaseException:
            os.close(fd)
            raise
        return Fd(fd, direct)

    def _open_source(self, path: str, flags: int) -> int:
        """Open ``path``; with ``confine``, refuse what the descriptor really is outside the
        roots (a link swapped in after planning)."""
        fd = os.open(path, flags | os.O_NONBLOCK)  # a FIFO swapped in must not block us
        if self.confine and not beneath(opened_path(fd), self.confine):
            os.close(fd)
            raise PermissionError(errno.EACCES, "resolves outside the allowed roots", path)
        return fd

    def _open_tmp(self, path: str, flags: int) -> Fd:
        """A temporary file to write (direct as ``IoPolicy.writes_direct`` says)."""
        direct = self.algo != "none" and self.policy.writes_direct()
        return Fd(_open_temp(path, flags | (os.O_DIRECT if direct else 0)), direct)

    def _tmp_dir(self, sub: str = "") -> int:
        """The descriptor of DEST's temp directory (``sub``: that subdirectory of it, made
        where missing), opened once, beneath DEST's ``.datastore`` (:func:`open_beneath`): its
        temp files are named through it, so a directory swapped for a link while the stage
        runs takes none of them (by path, files were written where it led: 16 of 4,000 then
        failed to place)."""
        with self._lock:
            fd = self._tmp_dirs.get(sub)
            if fd is None:
                fd = open_beneath(fd_path(self._meta), os.path.join("tmp", sub), make=True)
                self._tmp_dirs[sub] = fd
        return fd

    def close(self) -> None:
        """Close the descriptors of the temp directories and ``.datastore`` (:meth:`run` does
        at its end; one left open keeps a DEST's filesystem busy)."""
        with self._lock:
            for fd in self._tmp_dirs.values():
                os.close(fd)
            self._tmp_dirs.clear()
            if self._meta >= 0:
                os.close(self._meta)
                self._meta = -1

    def _fail(self, item: Item, exc: BaseException) -> None:
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        with self._lock:
            self.stats.errors.append(f"{item.source}: {msg}")

    def _tmp_path(self, item: Item, ahead: bool = False) -> str:
        """``tmp/K/KEY.part``: spread over 16 directories, which the filesystem spreads over
        its block groups (:func:`_spread_subdirs`). ``ahead``: a member written ahead of the
        plan, keyed by its offset too (of two members of one name, the walk writes both
        before the last is known to win)."""
        name = os.fsencode(item.dest) + (b"\0%d" % item.offset if ahead else b"")
        key = hashlib.sha1(name).hexdigest()[:20]  # any file name bytes
        return fd_path(self._tmp_dir(tmp_subdir(key)), key + ".part")

    def _tmp_or_fail(self, item: Item, ahead: bool = False) -> str | None:
        """:meth:`_tmp_path`, or ``None`` where its directory cannot be made (no inode left on
        DEST): then the item fails by name, unless written ahead (left for :meth:`run`)."""
        try:
            return self._tmp_path(item, ahead)
        except OSError as exc:
            if not ahead:
                self._fail(item, exc)
            return None

    def _record(self, item: Item, digest: str | None, size: int) -> dict[str, Any]:
        return {
            "entry": item.dest,
            "kind": item.kind,
            "source": item.source,
            "ident": item.ident,
            "size": size,
            "hash": digest,
            "link": item.link if item.kind == "symlink" else None,
        }

    def _finish(
        self,
        item: Item,
        out: Fd,
        tmp: str,
        digest: str | None,
        written_back: bool = False,
        hold: bool = False,
    ) -> None:
        """Close a finished temp file and hand it to the committer; ``written_back``: its
        writeback already started (``copy_range`` starts it piece by piece); ``hold``: keep
        it hidden until :meth:`settle` decides (written ahead of the plan)."""
        fd = out.fd
        try:
            if out.direct and item.size % ALIGN:
                os.ftruncate(fd, item.size)  # drop the padding of the last direct write
            os.fchmod(fd, item.mode & self.mode_mask)
            try:
                os.utime(fd, ns=(item.mtime_ns, item.mtime_ns))
            except OverflowError:  # written ahead: the walk refuses the archive later
                raise OSError(errno.EOVERFLOW, "modification time out of range") from None
            if not (out.direct or written_back):
                start_writeback(fd)
        finally:
            os.close(fd)
        if hold:
            with self._lock:
                self._held[item] = (tmp, digest)
            return
        self._publish(item, tmp, digest)

    def _publish(self, item: Item, tmp: str, digest: str | None) -> None:
        """Hand a finished temp file to the committer, which places it under its name (and
        counts it once placed)."""
        self.committer.add(tmp, item.dest, self._record(item, digest, item.size), item.size)

    # -- range copies ------------------------------------------------------------------------
    def _copy_small(self, item: Item, src_path: str, src_off: int) -> None:
        tmp = self._tmp_or_fail(item)
        if tmp is None:
            return
        try:
            fd = self._open_tmp(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            try:
                whole = src_off == 0 and item.size <= BUFFERED_BYTES
                with self._source(src_path, whole) as src:
                    holes = item.sparse and not (src.direct or fd.direct)
                    if holes:
                        os.ftruncate(fd.fd, item.size)
                    d = copy_range(
                        src, fd, src_off, 0, item.size, self.algo, stop=self._stop, holes=holes
                    )
                    _unchanged(item, os.fstat(src.fd))
            except BaseException:
                os.close(fd.fd)
                raise
            self.on_bytes(item.size)
            digest = combine(self.algo, [d]) if self.algo != "none" else None
            self._finish(item, fd, tmp, digest, written_back=True)
        except (OSError, ValueError) as exc:
            _unlink(tmp)
            self._fail(item, exc)

    def _copy_extent(self, items: list[Item], ahead: bool = False) -> None:
        """Copy neighbouring members of one archive with a single read of their whole span.
        ``ahead``: written ahead of the plan (:meth:`ahead`): held, not placed, not counted,
        and a failure is left for :meth:`run` to meet and report."""
        base = items[0].offset
        span = items[-1].offset + items[-1].size - base
        try:
            buf = _buffer(span)
            with self._source(items[0].path) as src:
                got = len(read_at(src.fd, buf, base, span, src.direct))
            if got < span:
                raise OSError(errno.EIO, "archive ended early (changed while staging?)")
        except OSError as exc:
            for item in () if ahead else items:
                self._fail(item, exc)
            return
        for item in items:
            rel = item.offset - base
            view = buf[rel : rel + item.size]
            tmp = self._tmp_or_fail(item, ahead)
            if tmp is None:
                continue
            try:
                self._write_small(item, [view], tmp, ahead)
            except OSError as exc:
                _unlink(tmp)
                if not ahead:
                    self._fail(item, exc)

    def _write_held(self, items: list[Item], held: list[Held]) -> None:
        """Write members ahead of the plan (:meth:`ahead`) from their bytes held in the
        walk's memory: hashed and written where they lie, no copy in between, each released
        once written. A failure is left for :meth:`run` to meet and report."""
        try:
            for item, data in zip(items, held, strict=True):
                tmp = self._tmp_path(item, True)
                try:
                    if item.size > BUF_BYTES - ALIGN:
                        self._stream_held(item, data, tmp)
                        continue
                    self._write_small(item, data.views(), tmp, True)
                except OSError:
                    _unlink(tmp)
                finally:
                    data.release()
        finally:
            _release(held)  # what an unforeseen error left held (else the walk waits)

    def _write_small(self, item: Item, views: list[memoryview], tmp: str, ahead: bool) -> None:
        """Write a member of at most one extent, its bytes ``views`` one after another, into
        ``tmp``, hashed as its one leaf, and finish it (``ahead``: held, not counted)."""
        out = self._open_tmp(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            digest = None
            if self.algo != "none":
                h = new_hasher(self.algo)
                for view in views:
                    h.update(view)
                digest = combine(self.algo, [h.digest()])
            if len(views) == 1:
                self._write_view(out, views[0])
            elif out.direct:  # one aligned buffer of the pieces
                buf = _buffer(item.size)
                buf[: item.size] = b"".join(views)
                self._write_view(out, buf[: item.size])
            else:
                _write_views(out.fd, views)
        except BaseException:
            os.close(out.fd)
            raise
        if not ahead:
            self.on_bytes(item.size)
        self._finish(item, out, tmp, digest, hold=ahead)

    def _stream_held(self, item: Item, data: Held, tmp: str) -> None:
        """Write a member larger than one extent piece by piece as the walk's reader brings
        it in, hashed leaf by leaf (``staging.checksum``), each piece let go once written."""
        out = Fd(_open_temp(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))  # never direct
        try:
            digests: list[bytes] = []
            h, left, pos = None, 0, 0
            for piece in data.pieces():
                _write_views(out.fd, [piece], pos)
                start_writeback(out.fd, pos, len(piece))
                pos += len(piece)
                while self.algo != "none" and piece:
                    if not left:
                        if h is not None:
                            digests.append(h.digest())
                        h, left = new_hasher(self.algo), LEAF_BYTES
                    n = min(left, len(piece))
                    h.update(piece[:n])
                    piece, left = piece[n:], left - n
        except BaseException:
            os.close(out.fd)
            raise
        if h is not None:
            digests.append(h.digest())
        digest = combine(self.algo, digests) if h is not None else None
        self._finish(item, out, tmp, digest, written_back=True, hold=True)

    def _write_view(self, out: Fd, view: memoryview) -> None:
        """Write ``view`` at offset 0 without touching the bytes around it in its buffer."""
        n = len(view)
        if not out.direct:
            write_at(out.fd, view, n, 0, False)
            return
        whole = n & ~(ALIGN - 1)
        if whole and self._direct_from_512:
            try:
                write_at(out.fd, view, whole, 0, True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_from_512 = False  # this filesystem wants aligned memory
                whole = 0
        else:
            whole = 0
        rest = n - whole
        if rest:
            tail = _tail_buffer(rest)
            tail[:rest] = view[whole:]
            write_at(out.fd, tail, rest, whole, True)

    def _copy_large(
        self, pool: ThreadPoolExecutor, item: Item, src_path: str, src_off: int
    ) -> list[Future]:
        """Submit one job per leaf; the last leaf to finish commits the file."""
        tmp = self._tmp_or_fail(item)
        if tmp is None:
            return []
        leaves = leaf_ranges(item.size)
        try:
            log, fd = self._open_large(item, tmp)
        except OSError as exc:  # its partial copy, if any, stays: a re-run resumes it
            self._fail(item, exc)
            return []
        digests: list[bytes] = [b""] * len(leaves)
        fresh = item.sparse and not log.known  # a resumed file may hold bytes where holes go
        state = {"left": len(leaves), "failed": False}
        guard, writing = threading.Lock(), threading.Lock()

        def leaf(i: int, off: int, length: int) -> None:
            try:
                kept = log.known.get(i)
                if (
                    kept is not None
                    and self.algo != "none"
                    and hash_range(fd.fd, off, length, self.algo, fd.direct) == kept
                ):
                    digests[i] = kept
                    with self._lock:
                        self.stats.resumed_bytes += length
                else:
                    with self._source(src_path) as src:
                        holes = fresh and not (src.direct or fd.direct)
                        digests[i] = copy_range(
                            src, fd, src_off + off, off, length, self.algo, writing, self._stop,
                            holes,
                        )  # fmt: skip
                        _unchanged(item, os.fstat(src.fd))
                    log.record(i, digests[i])
                self.on_bytes(length)
            except (OSError, ValueError) as exc:
                with guard:
                    first = not state["failed"]
                    state["failed"] = True
                if first:
                    self._fail(item, exc)
            with guard:
                state["left"] -= 1
                last = state["left"] == 0
            if last:
                log.close()
                if state["failed"]:
                    os.close(fd.fd)
                    return  # the temp file and its leaf log stay: a re-run resumes them
                digest = combine(self.algo, digests) if self.algo != "none" else None
                try:
                    self._finish(item, fd, tmp, digest, written_back=True)
                except (OSError, ValueError) as exc:  # named like a leaf's failure; resumable
                    self._fail(item, exc)
                    return
                _unlink(log.path)

        return [pool.submit(leaf, i, off, n) for i, (off, n) in enumerate(leaves)]

    def _open_large(self, item: Item, tmp: str) -> tuple[_LeafLog, Fd]:
        """The leaf log of a large copy and its temp file ``tmp``, at the item's size (kept
        where the log knows leaves of it, else new)."""
        log = _LeafLog(tmp[: -len(".part")] + ".leaves", f"{item.source} {item.ident} {self.algo}")
        try:
            if not log.known:
                _unlink(tmp)
            fd = self._open_tmp(tmp, os.O_RDWR | os.O_CREAT)
        except BaseException:
            log.close()
            raise
        try:
            os.ftruncate(fd.fd, item.size)
        except BaseException:
            os.close(fd.fd)
            log.close()
            raise
        return log, fd

    def _copy_file(
        self, pool: ThreadPoolExecutor, item: Item, src_path: str, src_off: int
    ) -> list[Future]:
        if item.size > LEAF_BYTES:
            return self._copy_large(pool, item, src_path, src_off)
        return [pool.submit(self._copy_small, item, src_path, src_off)]

    def _symlink(self, item: Item) -> None:
        tmp = self._tmp_or_fail(item)
        if tmp is None:
            return
        try:
            _unlink(tmp)
            os.symlink(item.link, tmp)
        except OSError as exc:
            self._fail(item, exc)
            return
        self.committer.add(tmp, item.dest, self._record(item, None, 0), 0)

    # -- streams (compressed archives) ---------------------------------------------------------
    def _extract_stream(self, group: Group) -> None:
        """One sequential pass over a compressed archive: each member's bytes are read once and
        written for every item that holds them (the member, the hardlinks that copy it)."""
        todo: dict[int, list[Item]] = {}  # by the index of the member that holds them
        for i in group.items:
            if i.kind != "dir":
                todo.setdefault(i.offset, []).append(i)
        try:
            with _raw_stream(group) as stream, tarfile.open(fileobj=stream, mode="r|") as tf:
                index = -1  # counted as list_members counts: the "./" root entry is no member
                for info in tf:
                    _check(self._stop)
                    index += bool(normalize_name(info.name))
                    items = todo.get(index, [])
                    if items and items[0].kind == "symlink":
                        self._symlink(items[0])
                    elif items and info.isreg():
                        self._write_member(items, tf.extractfile(info))
        except DECODE_ERRORS as exc:
            self.stats.errors.append(f"{group.source}: corrupt or truncated archive ({exc})")

    def _write_member(self, items: list[Item], f: Any) -> None:
        """Write the bytes of one member, read once from ``f``, into the temp file of each of
        ``items``."""
        outs: list[tuple[str, Fd]] = []
        try:
            for item in items:
                tmp = self._tmp_path(item)
                outs.append((tmp, self._open_tmp(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)))
            digest = self._fill_copies(f, items[0].size, [out for _, out in outs])
        except OSError as exc:
            _discard(outs)
            for item in items:
                self._fail(item, exc)
            return
        except BaseException:
            _discard(outs)
            raise
        for item, (tmp, out) in zip(items, outs, strict=True):
            try:
                self._finish(item, out, tmp, digest)
            except OSError as exc:
                _unlink(tmp)
                self._fail(item, exc)

    def _fill_copies(self, f: Any, size: int, outs: list[Fd]) -> str | None:
        """Write ``size`` bytes read from ``f`` into each of ``outs``; returns their digest."""
        digests = []
        buf = _buffer(size)
        for off, length in leaf_ranges(size):
            h = new_hasher(self.algo) if self.algo != "none" else None
            done = 0
            while done < length:
                _check(self._stop)
                want = min(BUF_BYTES, length - done)
                _fill(f, buf[:want])
                if h is not None:
                    h.update(buf[:want])
                for out in outs:
                    write_at(out.fd, buf, want, off + done, out.direct)
                done += want
            self.on_bytes(length * len(outs))
            if h is not None:
                digests.append(h.digest())
        return combine(self.algo, digests) if self.algo != "none" else None

    # -- ahead of the plan ----------------------------------------------------------------------
    def ahead(self, item: Item, held: Held | None = None) -> None:
        """Start writing member ``item`` of an uncompressed tar while the walk over the archive
        goes on (``build_plan(ahead=...)``; the walk calls this as it reads each header), from
        its bytes ``held`` in the walk's memory (released here once written or declined), or
        else read from the archive.

        Neighbouring members are gathered into extents and copied by the engine's streams
        into hidden temp files under ``DEST/.datastore/tmp/``, as :meth:`run` would copy
        them; nothing is placed under its name before :meth:`settle` has kept it (the archive
        checked as a whole, its space counted) and :meth:`run` commits it. An extent that
        would not fit in the space free on DEST when the first was written stops the writing
        ahead. A member larger than one extent is written on its own, streamed through the
        walk's memory; without ``held`` it is left to :meth:`run`.
        """
        big = item.size > BUF_BYTES - ALIGN
        if item in self._ahead_seen or self._room == 0 or (big and held is None):
            if held is not None:
                held.release()
            return
        self._ahead_seen.add(item)
        run = self._pending
        if run and (big or not _joins(run, item)):
            self._write_ahead(run, self._pending_held)
            run, self._pending, self._pending_held = [], [], []
        if big:
            self._write_ahead([item], [held])
            return
        self._pending = run
        run.append(item)
        self._pending_held.append(held)

    def _write_ahead(self, run: list[Item], held: list[Held | None]) -> None:
        nbytes = sum(i.size for i in run)
        if self._room is None:
            usage = shutil.disk_usage(self.dest)
            self._room = usage.free if usage.total else 0  # no capacity known: no room
        if nbytes > self._room:
            self._room = 0
            _release(held)
            return
        self._room -= nbytes
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(self.streams, thread_name_prefix="ahead")
        with self._lock:
            self._archives.add(run[0].path)
        if all(h is not None for h in held):
            self._ahead_pool.submit(self._write_held, run, held)
        else:
            _release(held)
            self._ahead_pool.submit(self._copy_extent, run, True)

    def settle(self, groups: list[Group]) -> int:
        """Keep what :meth:`ahead` wrote for an item of ``groups`` (this rank's work, after
        the plan's checks and the skips) and remove the rest: the members of an archive
        refused late in its walk, or skipped. Returns the bytes kept, which :meth:`run`
        places without copying them again; ``settle([])`` removes everything written ahead."""
        self._finish_ahead(flush=bool(groups))
        wanted = {i for g in groups if g.ident and not g.stream for i in g.items}
        kept = {}
        for item, held in self._held.items():
            if item in wanted:
                kept[item] = held
            else:
                _unlink(held[0])
        self._held = kept
        return sum(i.size for i in kept)

    def _finish_ahead(self, flush: bool = True) -> None:
        """Wait for every extent handed to the streams ahead of the plan; ``flush``: hand
        them the extent the walk was gathering when it ended, else let it go."""
        if flush and self._pending:
            self._write_ahead(self._pending, self._pending_held)
        else:
            _release(self._pending_held)
        self._pending, self._pending_held = [], []
        if self._ahead_pool is not None:
            self._ahead_pool.shutdown(wait=True)
            self._ahead_pool = None

    # -- driver ------------------------------------------------------------------------------
    def run(self, groups: list[Group]) -> Stats:
        """Stage ``groups`` (already filtered to what this rank must write; the members that
        :meth:`settle` kept are placed as they are)."""
        try:
            self.journal = Journal(self.dest, self.rank, self._meta)
        except OSError as exc:  # (no inode left for it): nothing is placed without its record
            self.stats.errors.append(f"{self.dest}: cannot write its journal: {exc.strerror}")
            return self.stats
        self.committer = Committer(self.dest, self.journal)
        self._archives = {g.source for g in groups if g.ident and not g.stream}
        done, self._held = self._held, {}
        for item, (tmp, digest) in done.items():
            self.on_bytes(item.size)
            self._publish(item, tmp, digest)
        try:
            with ThreadPoolExecutor(self.streams, thread_name_prefix="stream") as pool:
                try:
                    self._copy_all(pool, groups, done)
                except BaseException:  # Ctrl-C: stop now, not once every queued copy is done
                    self._stop.set()
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        finally:
            self.committer.close()
            self.journal.close()
            self.close()
        self.stats.add(self.committer.placed)
        self.stats.errors.extend(self.committer.errors)
        return self.stats

    def _copy_all(
        self, pool: ThreadPoolExecutor, groups: list[Group], done: dict[Item, Any]
    ) -> None:
        """Copy ``groups`` with the streams of ``pool`` (what is in ``done`` is placed
        already) and wait for every copy."""
        futures: list[Future] = []
        streams = [g for g in groups if g.stream]
        stream_job = pool.submit(self._run_streams, streams) if streams else None
        for g in groups:
            if g.stream:
                continue
            for item in (i for i in g.items if i.kind == "symlink"):
                self._symlink(item)
            files = [i for i in g.items if i.kind != "symlink" and i not in done]
            if g.ident:  # an uncompressed tar: small members in extents
                small = [i for i in files if i.size <= BUF_BYTES - ALIGN]
                for run in extents(small):
                    futures.append(pool.submit(self._copy_extent, run))
                files = [i for i in files if i.size > BUF_BYTES - ALIGN]
            for item in sorted(files, key=lambda i: -i.size):
                futures.extend(self._copy_file(pool, item, item.path, item.offset))
        if stream_job is not None:
            stream_job.result()
        for fut in futures:
            fut.result()

    def _run_streams(self, groups: list[Group]) -> None:
        for g in groups:
            self._extract_stream(g)


def _raw_stream(group: Group) -> Any:
    """The tar byte stream of a stream group: decompressed, or the plain (sparse) tar itself."""
    if group.stream == "tar":
        return open(group.source, "rb")
    return open_stream(group.source, group.stream or "")


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_TOPDIR_FL = 0x80086601, 0x40086602, 0x00020000


def _spread_subdirs(path: str) -> None:
    """Ask the filesystem to spread the subdirectories of ``path`` over its block groups
    (ext2/3/4's top-directory flag, ``chattr +T``); nothing where it has no such flag.

    Else ext4 puts the temp files in the block group of their parent, where an unjournaled
    ext4 also keeps the inodes of files deleted in the last minutes, and passes over every
    one of those for each file it creates (a DEST staged again after ``rm -rf``: 28 % of the
    stage's CPU time, GlusterFS tar of 1,000 x 512 KiB); spread, 8 %."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        if not flags[0] & FS_TOPDIR_FL:
            flags[0] |= FS_TOPDIR_FL
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
    except OSError:
        pass  # no such flags here (ENOTTY, EOPNOTSUPP, EINVAL)
    finally:
        os.close(fd)


def _release(held: list[Held | None]) -> None:
    for h in held:
        if h is not None:
            h.release()


def _write_views(fd: int, views: list[memoryview], offset: int = 0) -> None:
    """Write ``views`` one after another from ``offset`` (``pwritev``, again where short)."""
    done = offset
    while views:
        n = os.pwritev(fd, views, done)
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]


def _fill(f: Any, view: memoryview) -> None:
    """Fill ``view`` from the file object ``f`` (whose reads may come back short)."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError(errno.EIO, "archive member ended early")
        got += n


def hash_range(fd: int, off: int, length: int, algo: str, direct: bool = False) -> bytes:
    """The digest of ``length`` bytes at ``off`` (fewer if the file ends first)."""
    h = new_hasher(algo)
    buf = _buffer(length)
    done = 0
    while done < length:
        data = read_at(fd, buf, off + done, min(BUF_BYTES, length - done), direct)
        if not data:
            break
        h.update(data)
        done += len(data)
    return h.digest()

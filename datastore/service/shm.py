"""Shared-memory segments: how large batches reach a trainer on the same node without a copy.

The service owns every segment: one file per stream under ``/dev/shm`` (0600, named
``datastore.<uid>.<pid>.<id>``), mapped by the service and by the one client that streams. The
service removes it when the stream ends, however it ends (done, cancelled, client killed); a
client's mapping stays valid after that (Linux frees the pages at its last unmap). Segments
left by a service that was killed are removed by the next service of the same user on start
(their owner pid is dead), so a crashed run never blocks or leaks into the next one; a service
that stops removes whatever of its own is still there (:func:`remove_own`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from datastore.errors import DataStoreError

__all__ = [
    "ClientMaps", "Segment", "disk_backed", "filesystem_of", "reclaim_stale", "remove_own",
    "segment_dir",
]  # fmt: skip

PREFIX = "datastore"
# madvise(2) advice: map a range's pages in one call, keeping their contents (Linux 5.14)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)


def segment_dir() -> Path:
    """Where segments live: ``DATASTORE_SHM_DIR`` from the service's environment (e.g. a
    larger tmpfs where ``/dev/shm`` is a container's 64 MiB, or a job's own), else ``/dev/shm``
    if the node has it, else the temporary directory.

    Raises:
        ValueError: ``DATASTORE_SHM_DIR`` is not a directory this user can write.
    """
    chosen = os.environ.get("DATASTORE_SHM_DIR", "").strip()
    if chosen:  # absolute: clients open the paths the service sends from their own cwd
        path = Path(chosen).absolute()
        if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"DATASTORE_SHM_DIR={chosen}: not a directory this user can write")
        return path
    shm = Path("/dev/shm")
    return (
        shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))
    )


MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})  # file systems held in memory


def filesystem_of(directory: Path) -> str | None:
    """The type of the file system ``directory`` lies on (``/proc/self/mountinfo``'s longest
    mount point above it), or ``None`` where that cannot be read."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(directory), "", None
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        point = fields[4].encode().decode("unicode_escape")  # (spaces come as \040)
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[fields.index("-", 6) + 1]
    return kind


def disk_backed(directory: Path) -> str | None:
    """Why segments in ``directory`` would be slow (its file system is not held in memory:
    every batch written would also go to a disk), or ``None``."""
    kind = filesystem_of(directory)
    if kind is None or kind in MEMORY_FS:
        return None
    return (
        f"shared-memory segments in {directory} lie on {kind}, not in memory (tmpfs): batches "
        "are written back to its disk; point DATASTORE_SHM_DIR at a tmpfs"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owned(directory: Path, pattern: str) -> list[Path]:
    """The files matching ``pattern`` in ``directory`` that this user owns: another user may
    name a file in ``/dev/shm`` as one of ours, and it cannot be removed (the sticky bit)."""
    owned = []
    for path in directory.glob(pattern):
        with contextlib.suppress(FileNotFoundError):
            if path.lstat().st_uid == os.getuid():
                owned.append(path)
    return owned


def reclaim_stale(directory: Path | None = None) -> list[Path]:
    """Remove this user's segments whose service is dead; the paths removed."""
    directory = directory or segment_dir()
    removed = []
    for path in _owned(directory, f"{PREFIX}.{os.getuid()}.*"):
        parts = path.name.split(".")
        if len(parts) != 4 or not parts[2].isdigit() or _alive(int(parts[2])):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def remove_own(directory: Path | None = None) -> list[Path]:
    """Remove every segment of this process (a stopping service: none may outlive it, whatever
    stream or session failed to remove its own); the paths removed (none where
    ``DATASTORE_SHM_DIR`` was removed: nothing is left there)."""
    try:
        directory = directory or segment_dir()
    except ValueError:
        return []
    removed = []
    for path in _owned(directory, f"{PREFIX}.{os.getuid()}.{os.getpid()}.*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


class Segment:
    """``slots`` equal regions of ``slot_bytes`` in one new shared-memory file.

    ``arrays(slot, layout)`` gives numpy views of a slot; ``close()`` removes the file.
    """

    def __init__(self, slots: int, slot_bytes: int, directory: Path | None = None) -> None:
        directory = directory or segment_dir()
        self.path = directory / f"{PREFIX}.{os.getuid()}.{os.getpid()}.{uuid.uuid4().hex[:16]}"
        self.slot_bytes = -(-max(1, slot_bytes) // 4096) * 4096  # page-aligned slots
        self.slots = slots
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self._fd, self.slots * self.slot_bytes)
            self._map = mmap.mmap(self._fd, self.slots * self.slot_bytes)
        except BaseException:
            os.close(self._fd)
            self.path.unlink()
            raise

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def fault_in(self, slot: int, gather: Any = None) -> None:
        """Put ``slot``'s pages in place, zeros as in a new file, the writes spread over the
        ``gather``'s threads (``datastore.store.gather.Gather``): faulting fresh shared memory
        in page by page during a batch's fill made each slot's first batch many times slower.
        Only for a slot that holds nothing yet (its first use). Its room is taken first, so a
        full filesystem is an ``OSError`` (``ENOSPC``) here: writing into pages it has no room
        for killed the service (``SIGBUS``)."""
        os.posix_fallocate(self._fd, self.offset(slot), self.slot_bytes)
        region = np.frombuffer(self._map, np.uint8, count=self.slot_bytes, offset=self.offset(slot))
        if gather is None:
            region.fill(0)
        else:
            gather.run([(region, None)])

    def array(self, slot: int, at: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A view of ``shape`` at byte ``at`` of ``slot``."""
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(
            self._map, dtype=dtype, count=count, offset=self.offset(slot) + at
        ).reshape(shape)

    def close(self) -> None:
        """Remove the file (views stay valid until they are dropped)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def unmap(self) -> None:
        """Unmap the segment here, unless a view of it is still alive (then it goes with the
        last view)."""
        with contextlib.suppress(BufferError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


class ClientMaps:
    """A client's mappings of the segments it was sent, one per file, kept while it streams.

    Args:
        copies_on: the CUDA stream that copies out of the mappings (the loader's side stream):
            each mapping is then page-locked (``cudaHostRegister``), so the copies run at
            pinned speed, and :meth:`drop` waits for that stream before unlocking. Default:
            ``None`` (pageable).
    """

    def __init__(self, copies_on: Any = None) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._placed: set[tuple[str, int]] = set()  # (path, offset): its pages mapped here
        self._copies_on = copies_on
        self._pinned: list[np.ndarray] = []  # a byte view of each page-locked mapping

    def __contains__(self, path: str) -> bool:
        return path in self._maps

    @property
    def pinned(self) -> int:
        """How many mappings are page-locked now."""
        return len(self._pinned)

    def array(self, path: str, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        m = self._maps.get(path)
        if m is None:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:  # (another /dev/shm: a container sharing only the socket)
                raise DataStoreError(
                    f"cannot map the service's shared memory {path} ({exc.strerror}): this "
                    "process must see the directory the service writes its segments to "
                    "(/dev/shm, or its DATASTORE_SHM_DIR), or stream inline "
                    '(ServiceOptions(transport="inline"))'
                ) from exc
            try:
                m = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            self._maps[path] = m
            if self._copies_on is not None:
                self._register(m)
        count = int(np.prod(shape, dtype=np.int64))
        if (path, offset) not in self._placed:
            self._placed.add((path, offset))
            _place(m, offset, count * np.dtype(dtype).itemsize)
        return np.frombuffer(m, dtype=dtype, count=count, offset=offset).reshape(shape)

    def _register(self, m: mmap.mmap) -> None:
        from datastore.store.device import register_host

        whole = np.frombuffer(m, dtype=np.uint8)
        with _on_device_of(self._copies_on):
            if register_host(whole.ctypes.data, whole.nbytes):
                self._pinned.append(whole)

    def drop(self) -> None:
        """Forget the mappings (each is unmapped once no tensor uses it). Page-locked ones are
        unregistered once the copies queued on ``copies_on`` so far are done (one may still
        read them): an event recorded on that stream is waited for, on the stream's own
        device whatever device is current. (``cudaHostUnregister`` itself then waited for the
        whole GPU on an H100: once per session, not per batch.)"""
        from datastore.store.device import unregister_host

        if self._pinned:
            import torch

            copied = torch.cuda.Event()
            copied.record(self._copies_on)
            copied.synchronize()
            with _on_device_of(self._copies_on):
                for whole in self._pinned:
                    unregister_host(whole.ctypes.data)
        self._pinned.clear()
        self._maps.clear()
        self._placed.clear()


def _place(m: mmap.mmap, offset: int, nbytes: int) -> None:
    """Map the pages of ``m``'s bytes ``[offset, offset + nbytes)`` in one call, the first
    time a batch there is read (page by page, as the batch is read, costs more; a kernel
    without ``MADV_POPULATE_READ`` leaves them to that). Only what is read: the whole segment
    at once (``MAP_POPULATE``) delayed a stream's first batch, putting in place the pages of
    slots the service had not filled yet."""
    if MADV_POPULATE_READ is None or nbytes <= 0:
        return
    start = offset - offset % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):
        m.madvise(MADV_POPULATE_READ, start, min(len(m), offset + nbytes) - start)


def _on_device_of(stream: Any) -> Any:
    """The CUDA device of ``stream`` made current (registrations belong to a device's
    context)."""
    import torch

    return torch.cuda.device(stream.device)

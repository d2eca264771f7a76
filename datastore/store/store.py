"""The in-memory store of one rank: fixed-shape slots for the samples (or blocks) it keeps.

Each field has one arena of ``(slots, *shape)``: touched once, then reused for the whole run
(on many nodes touching fresh memory costs more than copying into memory already touched).
Slots fill on first read (``get``) or all at once (``preload``).

Memory policy, in order: the first ``budget // bytes_per_slot`` slots live in RAM; the rest
spill to a file in ``spill_dir`` (mapped, and unlinked as soon as it is mapped, so not even a
``kill -9`` leaves it behind); without a ``spill_dir`` they are not kept and are read again from
the dataset on every use (they can always be re-read: the store never holds the only copy).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from datastore.store.keyindex import KeyIndex

__all__ = ["Counters", "SlotSpec", "Store", "StoreCounts"]


@dataclass
class StoreCounts:
    """What a store did. ``hits`` and ``misses`` count the reads asked for (a slot in memory,
    or read from disk then), not a preload's; ``bytes_read`` every byte read from disk."""

    bytes_resident: int = 0
    bytes_spilled: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class Counters(StoreCounts):
    """What a loader did: its store's counts (none with a service), its exchange's, and the
    time its consumer waited for batches."""

    bytes_exchanged: int = 0
    exchange_seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclass(frozen=True)
class SlotSpec:
    """The shape and dtype a field has in every slot."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


Fill = Callable[[int, str, np.ndarray], None]  # fill(key, field, out): read into out


def _arena(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array in a mapping of its own, unmapped once the last view of it goes:
    its memory returns to the system whatever malloc keeps (``datastore serve`` makes glibc keep
    up to 1 GiB of freed heap for its messages, `datastore.service.wire.keep_large_blocks`, so
    an arena from ``np.empty`` stayed in the process after its dataset was unloaded)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy asks for its large arrays
        buf.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


class Store:
    """Slots for ``keys`` (e.g. sample indices), one arena per field.

    Args:
        keys: the keys this store may hold, in slot order.
        fields: ``{field: SlotSpec}``.
        fill: reads ``(key, field)`` into a given array of the slot's shape.
        budget: bytes of RAM for slots; ``None`` keeps every slot in RAM. Default: ``None``.
        spill_dir: where slots beyond the budget go; ``None`` re-reads them. Default: ``None``.
    """

    def __init__(
        self,
        keys: np.ndarray,
        fields: dict[str, SlotSpec],
        fill: Fill,
        budget: int | None = None,
        spill_dir: str | None = None,
    ):
        self.keys = np.asarray(keys, dtype=np.int64)
        self._slot = KeyIndex(self.keys)  # no Python object per key
        self.fields, self._fill = fields, fill
        self.counters = StoreCounts()
        per_slot = sum(s.nbytes for s in fields.values())
        n = len(self.keys)
        self.ram_slots = n if budget is None or per_slot == 0 else min(n, budget // per_slot)
        self.spill_slots = n - self.ram_slots if spill_dir else 0
        self._ram = {f: _arena((self.ram_slots, *s.shape), s.dtype) for f, s in fields.items()}
        self._spill = self._map_spill(spill_dir, per_slot) if self.spill_slots else {}
        self._scratch = threading.local()
        self._filled = {f: np.zeros(n, dtype=bool) for f in fields}
        self._lock = threading.Lock()
        self._filling: dict[tuple[str, int], threading.Event] = {}  # slots being read now
        self.counters.bytes_resident = self.ram_slots * per_slot
        self.counters.bytes_spilled = self.spill_slots * per_slot

    def _map_spill(self, spill_dir: str, per_slot: int) -> dict[str, np.ndarray]:
        if not os.path.isdir(spill_dir):  # (its parent was checked: a typo makes nothing)
            os.mkdir(spill_dir)
        fd, path = tempfile.mkstemp(prefix="datastore-spill-", dir=spill_dir)
        try:
            os.ftruncate(fd, max(1, self.spill_slots * per_slot))
            buf = mmap.mmap(fd, max(1, self.spill_slots * per_slot))
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the space; nothing is left after exit
        out, off = {}, 0
        for f, s in self.fields.items():
            size = self.spill_slots * s.nbytes
            out[f] = np.frombuffer(
                buf, dtype=s.dtype, count=size // s.dtype.itemsize, offset=off
            ).reshape(self.spill_slots, *s.shape)
            off += size
        return out

    def __contains__(self, key: int) -> bool:
        return key in self._slot

    def resident(self, key: int) -> bool:
        """Whether ``key`` has a slot of its own (RAM or spill), rather than a re-read scratch."""
        return self._slot[int(key)] < self.ram_slots + self.spill_slots

    def in_ram(self, key: int, field: str) -> bool:
        """Whether ``(key, field)`` is read into its RAM slot: :meth:`get` is a view, at once."""
        slot = self._slot[int(key)]
        return slot < self.ram_slots and bool(self._filled[field][slot])

    def ram_views(self, keys: Sequence[int], fields: Sequence[str]) -> list[np.ndarray] | None:
        """Every ``(key, field)``'s RAM slot, field after field, key after key: views, valid
        for good, each counted a hit; ``None`` (nothing counted) where one is not read in."""
        slots = [self._slot[int(k)] for k in keys]
        if any(s >= self.ram_slots for s in slots):
            return None
        views = []
        for f in fields:
            filled, ram = self._filled[f], self._ram[f]
            for s in slots:
                if not filled[s]:
                    return None
                views.append(ram[s, ...])
        with self._lock:
            self.counters.hits += len(views)
        return views

    def _place(self, field: str, slot: int) -> np.ndarray | None:
        if slot < self.ram_slots:  # [slot, ...]: a view even for 0-d fields
            return self._ram[field][slot, ...]
        if slot - self.ram_slots < self.spill_slots:
            return self._spill[field][slot - self.ram_slots, ...]
        return None

    def get(self, key: int, field: str, asked: bool = True) -> np.ndarray:
        """The stored array of ``(key, field)``, read on first use. Valid until the next ``get``
        on this thread when the slot is neither in RAM nor spilled. A kept slot is read once:
        a thread that misses on a slot another is filling waits for that read. ``asked``:
        counted as a hit or a miss (not a preload's)."""
        slot = self._slot[int(key)]
        place = self._place(field, slot)
        spec = self.fields[field]
        if place is None:  # neither in RAM nor spilled: this thread's scratch, every time
            place = self._scratch_for(field, spec)
            self._read(int(key), field, place, asked)
            return place
        while True:
            with self._lock:
                if self._filled[field][slot]:
                    self.counters.hits += asked
                    return place
                busy = self._filling.get((field, slot))
                if busy is None:
                    busy = self._filling[(field, slot)] = threading.Event()
                    break
            busy.wait()  # filled, or its reader failed: look again (and read it ourselves)
        try:
            self._read(int(key), field, place, asked)
            self._filled[field][slot] = True
        finally:
            with self._lock:
                del self._filling[(field, slot)]
            busy.set()
        return place

    def _read(self, key: int, field: str, out: np.ndarray, asked: bool) -> None:
        self._fill(key, field, out)
        with self._lock:
            self.counters.misses += asked
            self.counters.bytes_read += self.fields[field].nbytes

    def lasting(self, key: int, field: str) -> np.ndarray:
        """:meth:`get`, valid for good: a re-read scratch array is copied (for copies or sends
        that run after this thread's next ``get``)."""
        arr = self.get(key, field)
        return arr if self.resident(key) else arr.copy()

    def _scratch_for(self, field: str, spec: SlotSpec) -> np.ndarray:
        bufs = self._scratch.__dict__.setdefault("bufs", {})
        if field not in bufs:
            bufs[field] = np.empty(spec.shape, spec.dtype)
        return bufs[field]

    def preload(self, threads: int = 4, stop: threading.Event | None = None) -> None:
        """Read every slot that is kept (RAM and spill) now, ``threads`` reads at a time
        (readers are thread-safe; those that release the GIL, like npy, read in parallel).
        Returns early, leaving the rest to be read on first use, once ``stop`` is set."""
        kept = (int(k) for k in self.keys[: self.ram_slots + self.spill_slots])
        take, failed = threading.Lock(), threading.Event()

        def fill() -> None:  # each worker takes the next key: nothing queued to drain on stop
            while not (failed.is_set() or (stop is not None and stop.is_set())):
                with take:
                    key = next(kept, None)
                if key is None:
                    return
                try:
                    for field in self.fields:
                        self.get(key, field, asked=False)
                except BaseException:
                    failed.set()
                    raise

        with ThreadPoolExecutor(max(1, threads)) as pool:
            for job in [pool.submit(fill) for _ in range(max(1, threads))]:
                job.result()

    def filled_bytes(self) -> int:
        """Bytes of the slots read so far (RAM and spill)."""
        return sum(
            int(np.count_nonzero(done)) * self.fields[f].nbytes for f, done in self._filled.items()
        )

    def close(self) -> None:
        self._ram.clear()
        self._spill.clear()

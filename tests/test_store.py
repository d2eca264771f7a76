"""The store's preload: everything read once, a stop honoured at once, a failing read raised."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from datastore.store import SlotSpec, Store

FIELDS = {"x": SlotSpec((4,), np.dtype(np.int64))}


def _store(n: int, fill) -> Store:
    return Store(np.arange(n, dtype=np.int64) * 3, FIELDS, fill)


def test_preload_reads_every_kept_sample_once():
    reads: list[int] = []
    lock = threading.Lock()

    def fill(key: int, field: str, out: np.ndarray) -> None:
        with lock:
            reads.append(key)
        out[:] = key

    store = _store(1000, fill)
    store.preload(threads=4)
    assert sorted(reads) == list(range(0, 3000, 3))
    assert store.get(30, "x").tolist() == [30] * 4 and len(reads) == 1000  # a hit: no new read


def test_a_stop_ends_the_preload_without_draining_a_queue():
    stop = threading.Event()
    reads = []

    def fill(key: int, field: str, out: np.ndarray) -> None:
        reads.append(key)
        if len(reads) == 10:
            stop.set()
        out[:] = key

    store = _store(1_000_000, fill)
    store.preload(threads=2, stop=stop)
    assert 10 <= len(reads) <= 12  # each worker finishes the sample it holds, then stops


def test_a_failing_read_stops_the_preload_and_is_raised():
    reads = []

    def fill(key: int, field: str, out: np.ndarray) -> None:
        reads.append(key)
        if key == 30:
            raise OSError(5, "disk gone")
        out[:] = key

    with pytest.raises(OSError, match="disk gone"):
        _store(100_000, fill).preload(threads=3)
    assert len(reads) < 100

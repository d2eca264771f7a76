"""The store's preload: everything read once, a stop honoured at once, a failing read raised;
its RAM views (what a peer's fetch is sent from)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from datastore.store.store import SlotSpec, Store

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


def test_threads_missing_on_one_slot_read_it_once():
    started, release = threading.Event(), threading.Event()
    reads = []

    def fill(key: int, field: str, out: np.ndarray) -> None:
        reads.append(key)
        started.set()
        release.wait(10)  # the first reader holds the slot while the others arrive
        out[:] = key

    store = _store(4, fill)
    got: list[list[int]] = []
    threads = [threading.Thread(target=lambda: got.append(store.get(6, "x").tolist()))
               for _ in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    started.wait(10)
    time.sleep(0.2)  # let the other three miss too (the asserts hold either way)
    release.set()
    for t in threads:
        t.join(10)
    assert reads == [6] and got == [[6] * 4] * 4
    assert (store.counters.misses, store.counters.hits) == (1, 3)


def test_a_failed_read_leaves_the_slot_to_the_next_reader():
    calls = []

    def fill(key: int, field: str, out: np.ndarray) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise OSError(5, "flaky disk")
        out[:] = key

    store = _store(2, fill)
    with pytest.raises(OSError, match="flaky disk"):
        store.get(3, "x")
    assert store.get(3, "x").tolist() == [3] * 4 and calls == [3, 3]


def test_ram_views_are_the_slots_read_in_or_none_and_count_hits():
    """Field after field, key after key: views of the RAM slots (no copy), each a hit; a key
    over the budget (re-read scratch) or a slot not read in yet gives ``None``, no hit."""
    fields = {"x": SlotSpec((4,), np.dtype(np.int64)), "y": SlotSpec((), np.dtype(np.int64))}

    def fill(key: int, field: str, out: np.ndarray) -> None:
        out[...] = key if field == "x" else -key

    store = Store(np.arange(5, dtype=np.int64) * 3, fields, fill, budget=3 * 40)  # 3 in RAM
    assert store.ram_views([3, 0], ["x"]) is None and store.counters.hits == 0  # not read
    for key in (0, 3, 6):
        store.get(key, "x"), store.get(key, "y")
    hits = store.counters.hits
    views = store.ram_views([6, 0], ["x", "y"])
    assert [v.tolist() for v in views] == [[6] * 4, [0] * 4, -6, 0]
    assert store.counters.hits == hits + 4
    assert np.shares_memory(views[0], store.get(6, "x"))
    assert store.ram_views([0, 9], ["x"]) is None  # 9: beyond the budget, never a RAM slot
    assert store.ram_views([0], ["x"]) is not None and store.counters.hits == hits + 6

"""KeyIndex: the slot of every key, for ranges and for arbitrary keys, without a dict."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from datastore.store.keyindex import KeyIndex
from datastore.store.store import SlotSpec, Store


@pytest.mark.parametrize(
    "keys",
    [
        np.arange(0, 10),
        np.arange(100, 1000, 7),  # a strided range
        np.arange(50, 0, -3),  # descending
        np.array([5]),
        np.array([9, 2, 40, -3, 17]),  # arbitrary
        np.random.default_rng(0).permutation(1000)[:300],
    ],
)
def test_every_key_finds_its_slot_and_nothing_else(keys):
    index = KeyIndex(keys)
    for slot, key in enumerate(keys):
        assert index[int(key)] == slot and key in index
    present = set(keys.tolist())
    for other in range(int(keys.min()) - 5, int(keys.max()) + 6):
        if other not in present:
            assert other not in index and index.find(other) == -1
            with pytest.raises(KeyError):
                index[other]


def test_empty_and_repeated_keys():
    assert 0 not in KeyIndex(np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match="key 4 appears more than once"):
        KeyIndex(np.array([1, 4, 2, 4]))


def test_a_range_costs_nothing_and_arbitrary_keys_16_bytes_each():
    n = 1_000_000
    keys = np.arange(n) * 3 + 5
    tracemalloc.start()
    ranged = KeyIndex(keys)
    ranged_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # Nothing kept; the check itself passes through one int64 diff and one bool array.
    assert ranged.nbytes == 0 and ranged_peak < 9 * n + 2**20
    scattered = KeyIndex(np.random.default_rng(1).permutation(n))
    assert scattered.nbytes == 16 * n


def test_the_store_looks_keys_up_through_it():
    keys = np.array([30, 10, 20])
    store = Store(keys, {"x": SlotSpec((2,), np.dtype(np.int64))}, lambda k, f, out: out.fill(k))
    assert [store.get(k, "x").tolist() for k in (10, 20, 30)] == [[10, 10], [20, 20], [30, 30]]
    assert 20 in store and 25 not in store
    with pytest.raises(KeyError):
        store.get(25, "x")

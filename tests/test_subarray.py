"""A box of an array as the contiguous messages both MPI exchanges send it in: the sizes a
receiver computes untold are the sizes the sender cuts, for every box of small arrays."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from datastore.maths.subarray import (
    outside,
    piece_sizes,
    pieces,
    run_bytes,
    run_layout,
    runs,
    view,
)


def boxes(shape: tuple[int, ...]):
    """Every box of ``shape`` (step-1 slices, empty ones too)."""
    per_axis = [[slice(a, b) for a in range(n + 1) for b in range(a, n + 1)] for n in shape]
    return itertools.product(*per_axis)


@pytest.mark.parametrize("min_run", [1, 8, 40, 1 << 20])
def test_the_sizes_a_receiver_computes_are_the_pieces_sent(min_run):
    array = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4)
    for box in boxes(array.shape):
        part = view(array, box)
        got = pieces(array, box, min_run)
        assert [p.nbytes for p in got] == piece_sizes(array.shape, 2, box, min_run), box
        assert b"".join(p.tobytes() for p in got) == part.tobytes(), box
        count, items = run_layout(array.shape, box)
        assert count * items == part.size, box
        if part.size:
            assert count == len(runs(part)), box


def test_the_run_length_of_a_parts_bytes_is_its_layouts():
    """A box of an int16 array, seen as its bytes (the last axis its bytes, strided as the
    data connection's asker receives into it): contiguous runs of the layout's items, 2 bytes
    each, for every non-empty box; a contiguous part is one run of all its bytes."""
    array = np.arange(2 * 3 * 4, dtype=np.int16).reshape(2, 3, 4)
    for box in boxes(array.shape):
        part = view(array, box).view(np.uint8)
        if part.size:
            assert run_bytes(part) == 2 * run_layout(array.shape, box)[1], box
    assert run_bytes(array.view(np.uint8)) == array.nbytes
    assert run_bytes(np.zeros((), np.uint8)) == 1


def test_short_runs_are_packed_long_ones_sent_in_place():
    array = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)
    box = (slice(0, 4), slice(1, 5), slice(0, 8))  # 4 runs of 4 x 8 items (128 bytes)
    assert run_layout(array.shape, box) == (4, 32)
    assert piece_sizes(array.shape, 4, box, min_run=128) == [128] * 4
    sent = pieces(array, box, min_run=128)
    assert all(np.shares_memory(p, array) for p in sent)
    assert piece_sizes(array.shape, 4, box, min_run=129) == [512]
    pack = np.empty(512, np.uint8)
    (packed,) = pieces(array, box, min_run=129, pack=pack)
    assert packed is pack and packed.view(np.float32).tolist() == array[box].ravel().tolist()
    assert run_layout((), ()) == (1, 1) and piece_sizes((), 8, ()) == [8]
    assert pieces(np.float64(2.5).reshape(()), ())[0].view(np.float64)[0] == 2.5


def test_a_bad_box_is_named():
    with pytest.raises(ValueError, match="not within shape"):
        run_layout((3,), (slice(2, 4),))
    with pytest.raises(ValueError, match="step-1"):
        run_layout((3,), (slice(0, 3, 2),))
    with pytest.raises(ValueError, match="a box of 1 axes for an array of shape"):
        run_layout((3, 4), (slice(0, 3),))


def test_the_slabs_outside_a_box_cover_the_rest_of_the_array_once():
    """Every item of the array outside the box in exactly one slab, none inside, for boxes
    touching each side or none, on every axis (3-d arrays of sides 1 to 3)."""
    spans = [(a, b) for a in range(4) for b in range(a, 4)]
    for shape in [(3, 3, 3), (1, 3, 2), (2, 1, 3)]:
        choices = [[(a, b) for a, b in spans if b <= n] for n in shape]
        for bounds in itertools.product(*choices):
            box = tuple(slice(a, b) for a, b in bounds)
            hits = np.zeros(shape, np.int64)
            for slab in outside(shape, box):
                hits[slab] += 1
            want = np.ones(shape, np.int64)
            want[box] = 0
            assert np.array_equal(hits, want), (shape, box)
    assert outside((4, 5), (slice(None), slice(None))) == []
    assert outside((4, 5), (slice(1, 3), slice(0, 5))) == [
        (slice(0, 1), slice(None)),
        (slice(3, 4), slice(None)),
    ]

"""Region reads of raw ``.npy`` data by contiguous runs equal numpy slicing, for any box."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.readers import npyfile


@st.composite
def array_and_box(draw):
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    box = []
    for n in shape:
        lo = draw(st.integers(0, n - 1))
        box.append(slice(lo, draw(st.integers(lo + 1, n))))
    return shape, tuple(box)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@settings(deadline=None, max_examples=150)
@given(array_and_box(), st.sampled_from([1, 1024]))
def test_box_read_equals_slicing(folder, case, max_runs):
    shape, box = case
    data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    path = folder / f"a{len(shape)}.npy"
    np.save(path, data)
    arr = npyfile.locate_npy(str(path))
    out = np.empty(data[box].shape, np.float32)
    old, npyfile.MAX_RUNS = npyfile.MAX_RUNS, max_runs  # 1: the memory-map path, else preadv
    try:
        arr.read_into(out, box)
    finally:
        npyfile.MAX_RUNS = old
    assert np.array_equal(out, data[box])

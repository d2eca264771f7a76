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
    npyfile._c_runs.cache_clear()
    try:
        arr.read_into(out, box)
    finally:
        npyfile.MAX_RUNS = old
        npyfile._c_runs.cache_clear()
    assert np.array_equal(out, data[box])


@pytest.mark.parametrize("layout", ["contiguous", "chunked", "slabs", "odd-chunks", "big-endian"])
def test_hdf5_plain_bytes_path_equals_h5py(tmp_path, layout):
    import h5py

    from datastore.readers import open_dataset

    data = np.random.default_rng(1).standard_normal((5, 3, 8, 8), dtype=np.float32)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        if layout == "contiguous":
            f["x"] = data
        elif layout == "chunked":
            f.create_dataset("x", data=data, chunks=(1, 3, 8, 8))
        elif layout == "slabs":
            f.create_dataset("x", data=data, chunks=(1, 3, 2, 8))
        elif layout == "odd-chunks":  # edge chunks overhang the data; several samples per chunk
            f.create_dataset("x", data=data, chunks=(2, 2, 3, 5))
        else:
            f.create_dataset("x", data=data.astype(">f4"))
    reader = open_dataset(str(path))
    box = (slice(1, 3), slice(2, 7), slice(0, 8))
    for i in range(5):
        assert np.array_equal(reader.read(i, "x", region=box), data[i][box])
        assert np.array_equal(reader.read(i, "x"), data[i])
    assert (reader._layout(0, reader.fields["x"]) is None) == (layout == "big-endian")

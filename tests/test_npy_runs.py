"""Region reads of raw ``.npy`` data by contiguous runs equal numpy slicing, for any box."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize("case", ["external-link", "12-bit", "bit-offset"])
def test_hdf5_data_whose_bytes_are_not_the_numpy_array_is_read_by_h5py(tmp_path, case):
    """The plain-bytes path read a dataset behind an external link at its offset in the wrong
    file (the one holding the link), and integers of fewer significant bits than their size
    as raw bytes (a 12-bit -1000 came back as 3096): both silently."""
    import h5py
    from h5py import h5t

    from datastore import DatasetSpec
    from datastore.readers import open_dataset

    path = tmp_path / "d.h5"
    if case == "external-link":
        want = np.random.default_rng(2).standard_normal((4, 2, 4, 4), dtype=np.float32)
        with h5py.File(tmp_path / "other.h5", "w") as f:
            f["pad"] = np.arange(1000.0)  # x's bytes lie after these in other.h5
            f["x"] = want
        with h5py.File(path, "w") as f:
            f["junk"] = np.full(5000, 42.0)
            f["x"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
    else:
        want = np.array([-1000, -1, 0, 5, 1000, -2048], np.int16).reshape(6, 1, 1, 1)
        kind = h5t.STD_I16LE.copy()
        kind.set_precision(12)
        if case == "bit-offset":
            kind.set_offset(2)
        with h5py.File(path, "w") as f:
            space = h5py.h5s.create_simple(want.shape)
            h5py.h5d.create(f.id, b"x", kind, space).write(h5py.h5s.ALL, h5py.h5s.ALL, want)
        with h5py.File(path) as f:
            assert np.array_equal(f["x"][...], want)  # h5py converts it
    reader = open_dataset(DatasetSpec("hdf5", (str(path),), fields=("x",)))
    assert reader._layout(0, reader.fields["x"]) is None
    for i in range(len(want)):
        assert np.array_equal(reader.read(i, "x"), want[i])


@pytest.mark.parametrize("kind", ["h5-contiguous", "h5-chunked", "npy-fortran", "npz"])
def test_a_file_replaced_after_its_layout_was_read_is_refused(tmp_path, kind):
    """Raw reads find the array at offsets (and a .npy's order) taken when the file was first
    read; a file replaced since (a new one renamed over it) was read at those offsets, silently:
    zeros for an HDF5 file, a transposed array for a .npy rewritten in Fortran order."""
    import h5py

    from datastore.readers import DatasetError, open_dataset

    data = np.arange(2 * 64 * 64, dtype=np.float32).reshape(2, 64, 64)
    path = tmp_path / ("d.h5" if kind.startswith("h5") else "s")

    def write(values, pad):
        if kind.startswith("h5"):
            with h5py.File(tmp_path / "new.h5", "w") as f:
                f["pad"] = np.arange(pad, dtype=np.float64)
                f.create_dataset(
                    "x", data=values, chunks=(1, 64, 64) if "chunked" in kind else None
                )
            os.replace(tmp_path / "new.h5", path)
            return
        path.mkdir(exist_ok=True)
        for i, v in enumerate(values):
            v = np.asfortranarray(v) if kind == "npy-fortran" and pad else v
            if kind == "npz":
                np.savez(tmp_path / "new.npz", pad=np.arange(pad), x=v)
                os.replace(tmp_path / "new.npz", path / f"{i}.npz")
            else:
                np.save(tmp_path / "new.npy", v)
                os.replace(tmp_path / "new.npy", path / f"{i}.npy")

    write(data, 0)
    reader = open_dataset(str(path), fields=() if kind == "npy-fortran" else ["x"])
    field = "data" if kind == "npy-fortran" else "x"
    assert np.array_equal(reader.read(1, field), data[1])
    write(data + 1, 3000)
    with pytest.raises(DatasetError, match=r"changed since the dataset was opened"):
        reader.read(1, field)


def test_a_dataset_behind_an_external_link_is_a_field_without_naming_it(tmp_path):
    """Fields were found with ``visititems``, which passes external links by: the linked ``x``
    was no field (``datastore inspect`` listed only ``y``; the loop's ``batch["x"]`` a
    ``KeyError``). A link that cannot be opened is named."""
    import h5py

    from datastore.readers import DatasetError, open_dataset

    x = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = x
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["y"] = np.arange(4)
        f["x"] = h5py.ExternalLink("other.h5", "/x")
    reader = open_dataset(str(tmp_path / "d.h5"))
    assert sorted(reader.fields) == ["x", "y"]
    assert np.array_equal(reader.read(3, "x"), x[3])
    os.remove(tmp_path / "other.h5")
    with pytest.raises(DatasetError, match=r"field 'x': external link to other.h5:/x cannot be"):
        open_dataset(str(tmp_path / "d.h5"))


@pytest.mark.parametrize("layout", ["one-file", "per-sample"])
def test_a_field_behind_a_filter_this_process_lacks_is_refused_when_opened(
    tmp_path, monkeypatch, layout
):
    """A plugin's filter (Zstd, without ``import hdf5plugin``): ``datastore inspect`` listed
    the file as fine, and every read then failed with ``OSError: Can't synchronously read data
    (can't open directory (/usr/local/lib/plugin) ...)``. Deflate stands in for the plugin."""
    import h5py
    from h5py import h5z

    from datastore.readers import DatasetError, open_dataset

    x = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    if layout == "one-file":
        with h5py.File(tmp_path / "d.h5", "w") as f:
            f.create_dataset("x", data=x, chunks=(1, 16), compression="gzip")
            f["y"] = np.arange(4)
        target = tmp_path / "d.h5"
    else:
        target = tmp_path / "d"
        target.mkdir()
        for i in range(2):
            with h5py.File(target / f"{i}.h5", "w") as f:
                f.create_dataset("x", data=x, chunks=(1, 16), compression="gzip")
                f["y"] = np.arange(3)
    monkeypatch.setattr(h5z, "filter_avail", lambda code: code != h5z.FILTER_DEFLATE)
    with pytest.raises(DatasetError, match=r"field 'x': compressed with HDF5 filter 1 \(deflate\)"):
        open_dataset(str(target), fields=["x"])
    assert len(open_dataset(str(target), fields=["y"])) == (4 if layout == "one-file" else 2)


def test_the_datasets_of_a_group_behind_an_external_link_are_fields(tmp_path):
    """A master file linking a run file's ``/entry/data`` group (NeXus-style): its datasets
    were no fields; they are now, by their paths through the link."""
    import h5py

    from datastore.readers import open_dataset

    x = np.arange(5 * 6, dtype=np.float32).reshape(5, 6)
    with h5py.File(tmp_path / "run.h5", "w") as f:
        f["entry/data/x"], f["entry/data/sub/y"] = x, np.arange(5)
    with h5py.File(tmp_path / "master.h5", "w") as f:
        f["data"] = h5py.ExternalLink("run.h5", "/entry/data")
        f["w"] = np.arange(5) * 2
    reader = open_dataset(str(tmp_path / "master.h5"))
    assert sorted(reader.fields) == ["data/sub/y", "data/x", "w"]
    assert np.array_equal(reader.read(3, "data/x"), x[3])
    assert reader.read(3, "data/sub/y") == 3


@pytest.mark.parametrize("first", ["read before", "not read before"])
def test_a_compressed_shard_replaced_after_the_set_was_opened_is_refused(
    tmp_path, monkeypatch, first
):
    """A set of gzip shards (read through h5py, not as raw bytes): a shard replaced by one of
    other rows after the set counted its samples was read with the old offsets when h5py
    opened it (first, or again once it left the reader's cache of open files), silently."""
    import h5py

    from datastore import DatasetSpec
    from datastore.readers import DatasetError, hdf5_reader, open_dataset

    def write(path, rows, value):
        with h5py.File(tmp_path / "new.h5", "w") as f:
            f.create_dataset("x", data=np.full((rows, 4), value, np.float32), compression="gzip")
        os.replace(tmp_path / "new.h5", path)

    monkeypatch.setattr(hdf5_reader, "MAX_OPEN_FILES", 1)  # one open file: the others leave
    paths = [tmp_path / f"s{k}.h5" for k in range(3)]
    for k, path in enumerate(paths):
        write(path, 2, k)
    reader = open_dataset(DatasetSpec("hdf5", tuple(map(str, paths)), fields=("x",)))
    assert reader._layout(0, reader.fields["x"]) is None  # compressed: read by h5py
    if first == "read before":
        assert reader.read(2, "x").tolist() == [1.0] * 4
        assert reader.read(0, "x").tolist() == [0.0] * 4  # s1.h5 left the cache
    write(paths[1], 3, 7)  # sample 2 would be 7s, samples 3 and 4 shifted
    with pytest.raises(DatasetError, match=r"s1\.h5: changed since the dataset was opened"):
        reader.read(2, "x")
    assert reader.read(4, "x").tolist() == [2.0] * 4  # the others read on


def test_a_file_behind_an_external_link_rewritten_after_it_was_read_is_refused(tmp_path):
    """The linked file's bytes were read as they were at each read: a store re-reading under
    its budget gave an epoch of 4 old samples (0.0) and 4 new ones (7.0), silently; a file
    of the dataset's own is refused so, and now the linked one too."""
    import h5py

    from datastore.readers import DatasetError, open_dataset

    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.zeros((4, 3), np.float32)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = h5py.ExternalLink("other.h5", "/x")
    reader = open_dataset(str(tmp_path / "d.h5"))
    assert reader.read(0, "x").tolist() == [0.0] * 3
    with h5py.File(tmp_path / "other.h5", "r+") as f:
        f["x"][...] = 7.0
    with pytest.raises(DatasetError, match=r"other\.h5, which it reads, changed since the data"):
        reader.read(1, "x")

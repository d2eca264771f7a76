"""A format added by registration alone: a reader defined here, registered, and read through
the spec, detection, spec files and the loader, no other module touched."""

from __future__ import annotations

import os

import numpy as np
import pytest

from datastore import DataStoreLoader
from datastore.readers import (
    FORMATS,
    DatasetError,
    DatasetSpec,
    FieldInfo,
    Format,
    Reader,
    open_dataset,
    register,
)
from datastore.readers.registry import resolve_paths

SIDE = 4  # each sample: one (1, SIDE, SIDE, SIDE) cube of little-endian int64, nothing else


class CubeReader(Reader):
    """``cube``: one ``.cube`` file per sample holding field ``v``, raw ``<i8`` bytes."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        shape = (1, SIDE, SIDE, SIDE)
        for f in self.files:
            if os.path.getsize(f) != 8 * SIDE**3:
                raise DatasetError(f, f"a .cube file holds {8 * SIDE**3} bytes")
        self._select_fields({"v": FieldInfo("v", np.dtype("<i8"), shape, (1, 2, 3))}, self.location)
        self._length = len(self.files)

    def _open(self) -> None:
        return None

    def _read_into(self, index, info, sel, out):
        out[...] = np.fromfile(self.files[index], dtype="<i8").reshape(info.shape)[sel]


@pytest.fixture
def cube():
    fmt = register(Format("cube", CubeReader, suffixes=(".cube",)))
    yield fmt
    FORMATS.pop("cube")


def _write(root, n: int) -> np.ndarray:
    root.mkdir()
    data = np.arange(n * SIDE**3, dtype="<i8").reshape(n, 1, SIDE, SIDE, SIDE)
    for i in range(n):
        data[i].tofile(root / f"s{i:03d}.cube")
    (root / "notes.txt").write_text("not a sample")
    return data


def test_a_registered_format_is_read_by_spec_detection_spec_file_and_glob(tmp_path, cube):
    data = _write(tmp_path / "cubes", 5)
    box = (slice(None), slice(1, 3), slice(0, 4), slice(2, 3))
    for dataset in (
        DatasetSpec("cube", (str(tmp_path / "cubes"),)),  # a directory: its .cube files
        str(tmp_path / "cubes"),  # detected by the suffix
        str(tmp_path / "cubes" / "s*.cube"),
    ):
        with open_dataset(dataset) as reader:
            assert type(reader) is CubeReader and reader.format == "cube"
            assert len(reader) == 5 and list(reader.fields) == ["v"]
            np.testing.assert_array_equal(reader.read(3, "v", box), data[3][box])
    spec_file = tmp_path / "cubes.toml"
    spec_file.write_text('format = "cube"\npaths = "cubes"\n')
    with open_dataset(str(spec_file)) as reader:
        np.testing.assert_array_equal(reader.read(4, "v"), data[4])


def test_the_loader_reads_a_registered_format(tmp_path, cube):
    data = _write(tmp_path / "cubes", 6)
    loader = DataStoreLoader(str(tmp_path / "cubes"), batch_size=3, shuffle=False, threads=1)
    batches = [b["v"].numpy() for b in loader]
    np.testing.assert_array_equal(np.concatenate(batches), data)


def test_messages_name_the_registered_formats(tmp_path, cube):
    with pytest.raises(DatasetError, match=r"unknown format 'raw' \(one of: .*, cube\)$"):
        DatasetSpec("raw", ("x",))
    (tmp_path / "a.bin").write_bytes(b"")
    with pytest.raises(DatasetError, match=r"a\.bin: not a dataset file \(.*\.tar, \.cube\)$"):
        open_dataset(str(tmp_path / "a.bin"))
    _write(tmp_path / "c", 1)
    with pytest.raises(DatasetError, match=r"layout= is for HDF5 files; these are cube$"):
        open_dataset(str(tmp_path / "c"), layout="shards")


def test_a_second_format_of_a_name_or_a_suffix_is_refused(cube):
    with pytest.raises(ValueError, match=r"^format 'cube' is registered already$"):
        register(Format("cube", CubeReader))
    with pytest.raises(
        ValueError, match=r"format 'h6': suffixes \['\.h5'\] belong to format 'hdf5' already$"
    ):
        register(Format("h6", CubeReader, suffixes=(".h5", ".h6")))
    assert list(FORMATS) == ["hdf5", "hdf5-per-sample", "lmdb", "npy", "tar", "zarr", "cube"]

"""Dataset readers on real files written by h5py, zarr (formats 2 and 3), lmdb and numpy.

Every read is compared exactly (``np.array_equal``, same dtype) with numpy slicing of the arrays
the files were written from; every bad input must raise ``DatasetError`` naming file and field.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import tarfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import lmdb
import numcodecs
import numpy as np
import pytest
import zarr

from datastore.readers import (
    DatasetError,
    DatasetSpec,
    FieldInfo,
    FieldSpec,
    detect,
    open_dataset,
    write_lmdb,
)
from datastore.readers.base import DatasetMissing, normalize_region
from datastore.readers.lmdb_format import META_KEY, sample_key

N, C, S = 5, 4, 16  # samples, channels, side: x is (C, S, S, S) float32, y is (C,) float32
X_AXES = (1, 2, 3)

# Regions of x: the first and last (8, 8, 8) blocks, an uneven box, one voxel, the whole.
X_REGIONS = [
    (slice(0, 4), slice(0, 8), slice(0, 8), slice(0, 8)),
    (slice(0, 4), slice(8, 16), slice(8, 16), slice(8, 16)),
    (slice(1, 3), slice(3, 14), slice(5, 6), slice(0, 11)),
    (slice(3, 4), slice(15, 16), slice(0, 1), slice(7, 8)),
    (slice(None), slice(None), slice(2, None), slice(None, 9)),
    (slice(0, 4), slice(0, 16), slice(0, 16), slice(0, 16)),
]
Y_REGIONS = [(slice(1, 3),), (slice(0, 4),), (slice(3, None),)]


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "x": rng.standard_normal((N, C, S, S, S), dtype=np.float32),
        "y": rng.uniform(-1, 1, size=(N, C)).astype(np.float32),
    }


# -- writers: one small dataset per format, written by the format's own library ----------------
@dataclass(frozen=True)
class Built:
    """A written dataset: what to open, the format ``detect`` must find, the fields it holds."""

    target: str | DatasetSpec
    fmt: str
    fields: tuple[str, ...] = ("x", "y")
    detect_path: str | None = None  # the path ``detect`` is tried on (``None``: not detectable)
    detected: tuple[FieldSpec, ...] = (FieldSpec("x", X_AXES), FieldSpec("y"))


def _hdf5(root: Path, a: dict, chunked: bool) -> Built:
    path = root / "train.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=a["x"], chunks=(1, C, 8, 8, 8) if chunked else None)
        f.create_dataset("y", data=a["y"])
    return Built(str(path), "hdf5", detect_path=str(path))


def _hdf5_shards(root: Path, a: dict) -> Built:
    for k, (lo, hi) in enumerate([(0, 3), (3, N)]):
        with h5py.File(root / f"shard{k}.h5", "w") as f:
            f.create_dataset("x", data=a["x"][lo:hi], chunks=(1, C, 8, 8, 8))
            f.create_dataset("y", data=a["y"][lo:hi])
    spec = DatasetSpec("hdf5", (str(root / "shard*.h5"),), (FieldSpec("x", X_AXES), "y"), "y")
    return Built(spec, "hdf5", detect_path=str(root / "shard*.h5"))  # 3 + 2 samples


def _hdf5_per_sample(root: Path, a: dict) -> Built:
    d = root / "cosmo"
    d.mkdir()
    for i in range(N):
        with h5py.File(d / f"sample_{i:03d}.h5", "w") as f:
            f.create_dataset("x", data=a["x"][i], chunks=(C, 8, 8, 8))
            f.create_dataset("y", data=a["y"][i])
            f.attrs["datastore_layout"] = "per-sample"  # x (4, ...), y (4,): shapes can't tell
    return Built(str(d), "hdf5-per-sample", detect_path=str(d))


def _zarr(root: Path, a: dict, zarr_format: int, shards: bool = False) -> Built:
    path = root / f"ds{zarr_format}.zarr"
    g = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    extra = {"shards": (1, C, 16, 16, 16)} if shards else {}
    x = g.create_array("x", shape=a["x"].shape, chunks=(1, C, 8, 8, 8), dtype="f4", **extra)
    x[:] = a["x"]
    y = g.create_array("y", shape=a["y"].shape, chunks=(2, C), dtype="f4")
    y[:] = a["y"]
    return Built(str(path), "zarr", detect_path=str(path))


def _lmdb(root: Path, a: dict, codec) -> Built:
    path = root / "ds.lmdb"
    samples = ({"x": a["x"][i], "y": a["y"][i]} for i in range(N))
    assert write_lmdb(path, samples, codec=codec) == N
    return Built(str(path), "lmdb", detect_path=str(path))


def npy_dir(root: Path, xs: np.ndarray) -> Path:
    """``root/npy`` holding sample ``i`` of ``xs`` as ``s{i}.npy``."""
    d = root / "npy"
    d.mkdir()
    for i, x in enumerate(xs):
        np.save(d / f"s{i}.npy", x)
    return d


def _npy(root: Path, a: dict) -> Built:
    d = root / "npy"
    d.mkdir()
    for i in range(N):
        np.save(d / f"sample_{i:04d}.npy", a["x"][i])
    spec = DatasetSpec("npy", (str(d),), (FieldSpec("x", X_AXES),))
    return Built(spec, "npy", ("x",), str(d), (FieldSpec("data", X_AXES),))


def _npz(root: Path, a: dict, compressed: bool) -> Built:
    d = root / "npz"
    d.mkdir()
    save = np.savez_compressed if compressed else np.savez
    for i in range(N):
        save(d / f"sample_{i:04d}.npz", x=a["x"][i], y=a["y"][i])
    return Built(str(d), "npy", detect_path=str(d))


def _member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _npz_bytes(compressed: bool, **arrs: np.ndarray) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrs)
    return buf.getvalue()


def _tar_npy(root: Path, a: dict) -> Built:
    d = root / "shards"
    d.mkdir()
    for k, (lo, hi) in enumerate([(0, 2), (2, N)]):
        with tarfile.open(d / f"shard-{k:02d}.tar", "w") as tf:
            train = tarfile.TarInfo("train")
            train.type = tarfile.DIRTYPE
            tf.addfile(train)  # directory members are skipped
            for i in range(lo, hi):
                _member(tf, f"train/sample_{i:04d}.npy", _npy_bytes(a["x"][i]))
    spec = DatasetSpec("tar", (str(d),), (FieldSpec("x", X_AXES),))
    return Built(spec, "tar", ("x",), str(d), (FieldSpec("data", X_AXES),))


def _tar_npz(root: Path, a: dict, compressed: bool) -> Built:
    path = root / "train.tar"
    with tarfile.open(path, "w") as tf:
        for i in range(N):
            data = _npz_bytes(compressed, x=a["x"][i], y=a["y"][i])
            _member(tf, f"sample_{i:04d}.npz", data)
    return Built(str(path), "tar", detect_path=str(path))


BUILDERS: dict[str, Callable[[Path, dict], Built]] = {
    "hdf5-chunked": lambda r, a: _hdf5(r, a, chunked=True),
    "hdf5-contiguous": lambda r, a: _hdf5(r, a, chunked=False),
    "hdf5-shards": _hdf5_shards,
    "hdf5-per-sample": _hdf5_per_sample,
    "zarr-v2": lambda r, a: _zarr(r, a, 2),
    "zarr-v3": lambda r, a: _zarr(r, a, 3),
    "zarr-v3-sharded": lambda r, a: _zarr(r, a, 3, shards=True),
    "lmdb-raw": lambda r, a: _lmdb(r, a, None),
    "lmdb-blosc": lambda r, a: _lmdb(r, a, numcodecs.Blosc(cname="lz4")),
    "lmdb-zstd": lambda r, a: _lmdb(r, a, numcodecs.Zstd(level=3)),
    "npy": _npy,
    "npz": lambda r, a: _npz(r, a, compressed=False),
    "npz-compressed": lambda r, a: _npz(r, a, compressed=True),
    "tar-npy": _tar_npy,
    "tar-npz": lambda r, a: _tar_npz(r, a, compressed=False),
    "tar-npz-compressed": lambda r, a: _tar_npz(r, a, compressed=True),
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def built(request, arrays, tmp_path_factory) -> Built:
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param), arrays)


def _regions(field: str) -> list:
    return X_REGIONS if field == "x" else Y_REGIONS


# -- reads ------------------------------------------------------------------------------------
def test_fields_length_and_bytes(built: Built, arrays):
    with open_dataset(built.target) as r:
        assert r.format == built.fmt
        assert len(r) == N
        assert list(r.fields) == list(built.fields)
        x = r.fields["x"]
        assert (x.dtype, x.shape, x.spatial_axes) == (np.dtype("<f4"), (C, S, S, S), X_AXES)
        if "y" in r.fields:
            assert r.fields["y"] == FieldInfo("y", np.dtype("<f4"), (C,), (), r.fields["y"].chunks)
        assert r.nbytes == sum(arrays[f][0].nbytes for f in built.fields) * N


def test_whole_samples_read_exactly(built: Built, arrays):
    with open_dataset(built.target) as r:
        for i in range(N):
            for field in built.fields:
                got = r.read(i, field)
                assert got.dtype == arrays[field].dtype
                assert np.array_equal(got, arrays[field][i])
        sample = r.read_sample(N - 1)
        assert list(sample) == list(built.fields)
        assert all(np.array_equal(sample[f], arrays[f][N - 1]) for f in built.fields)


def test_regions_read_exactly(built: Built, arrays):
    with open_dataset(built.target) as r:
        for i in (0, 2, N - 1):
            for field in built.fields:
                for region in _regions(field):
                    want = arrays[field][i][region]
                    got = r.read(i, field, region)
                    assert got.shape == want.shape
                    assert np.array_equal(got, want), (i, field, region)


def test_reads_fill_a_preallocated_out(built: Built, arrays):
    with open_dataset(built.target) as r:
        for field in built.fields:
            for region in _regions(field):
                want = arrays[field][3][region]
                out = np.full(want.shape, np.nan, dtype=np.float32)
                got = r.read(3, field, region, out=out)
                assert got is out
                assert np.array_equal(out, want)
        # an empty region is a valid (empty) read
        empty = r.read(1, "x", (slice(0, 4), slice(5, 5), slice(0, 16), slice(0, 16)))
        assert empty.shape == (4, 0, 16, 16)


def test_bad_out_buffers_are_rejected(built: Built):
    region = X_REGIONS[0]
    with open_dataset(built.target) as r:
        bad = {
            "shape": np.empty((4, 8, 8, 7), np.float32),
            "dtype": np.empty((4, 8, 8, 8), np.float64),
            "C-contiguous": np.empty((8, 8, 8, 4), np.float32).transpose(3, 0, 1, 2),
            "numpy array": [[0.0]],
        }
        for what, out in bad.items():
            with pytest.raises(DatasetError, match=what) as exc:
                r.read(0, "x", region, out=out)
            assert "field 'x'" in str(exc.value)


def test_threads_share_one_reader(built: Built, arrays):
    jobs = [(i % N, X_REGIONS[i % len(X_REGIONS)]) for i in range(48)]
    with open_dataset(built.target) as r:

        def work(job):
            i, region = job
            return np.array_equal(r.read(i, "x", region), arrays["x"][i][region])

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(work, jobs))


def test_pickled_reader_reopens(built: Built, arrays):
    with open_dataset(built.target) as r:
        r.read(0, "x")  # handles are open in this process: they must not travel
        clone = pickle.loads(pickle.dumps(r))
    with clone:
        assert clone.fields == r.fields and len(clone) == N
        assert np.array_equal(clone.read(4, "x", X_REGIONS[2]), arrays["x"][4][X_REGIONS[2]])


def _read_in_child(args):
    reader, i = args
    return reader.read(i, "x", X_REGIONS[2])


def test_forked_workers_read_with_their_own_handles(built: Built, arrays):
    with open_dataset(built.target) as r:
        r.read(1, "x")  # open handles in the parent before forking
        with multiprocessing.get_context("fork").Pool(2) as pool:
            got = pool.map(_read_in_child, [(r, i) for i in range(N)])
        assert all(np.array_equal(g, arrays["x"][i][X_REGIONS[2]]) for i, g in enumerate(got))
        assert np.array_equal(r.read(2, "x"), arrays["x"][2])  # the parent still reads


def test_detect(built: Built):
    if built.detect_path is None:
        pytest.skip("not detectable from its path")
    spec = detect(built.detect_path)
    assert spec.format == built.fmt
    assert spec.paths == (built.detect_path,)
    assert spec.fields == built.detected
    assert spec.label is None


def test_spec_field_missing_from_data(built: Built):
    spec = built.target if isinstance(built.target, DatasetSpec) else detect(built.target)
    wrong = DatasetSpec(spec.format, spec.paths, (FieldSpec("x", X_AXES), FieldSpec("label")))
    match = r"field 'label': (not in the data|\.npy samples hold one array; the spec names 2)"
    with pytest.raises(DatasetError, match=match) as exc:
        open_dataset(wrong)
    assert exc.value.path and exc.value.path.startswith(spec.paths[0].split("*")[0])
    assert exc.value.field == "label"


def test_bad_reads_name_file_and_field(built: Built):
    with open_dataset(built.target) as r:
        with pytest.raises(DatasetError, match="field 'nope': no such field") as exc:
            r.read(0, "nope")
        assert exc.value.path
        for index in (N, -1):
            with pytest.raises(DatasetError, match=r"field 'x': sample index .* out of range"):
                r.read(index, "x")
        cases = {
            r"\[0, 17\) is out of range": (slice(0, 4), slice(0, 17), slice(0, 8), slice(0, 8)),
            r"\[-1, 8\) is out of range": (slice(0, 4), slice(-1, 8), slice(0, 8), slice(0, 8)),
            r"\[9, 8\) is out of range": (slice(0, 4), slice(9, 8), slice(0, 8), slice(0, 8)),
            "step 2": (slice(0, 4), slice(0, 8, 2), slice(0, 8), slice(0, 8)),
            "region has 3 slice": (slice(0, 4), slice(0, 8), slice(0, 8)),
            "expected a slice": (0, slice(0, 8), slice(0, 8), slice(0, 8)),
        }
        for match, region in cases.items():
            with pytest.raises(DatasetError, match=match) as exc:
                r.read(1, "x", region)
            assert exc.value.field == "x" and exc.value.path, match
    with pytest.raises(DatasetError, match="closed reader"):
        r.read(0, "x")


# -- region reads fetch only the region -------------------------------------------------------
def _bytes_read() -> int:
    """Bytes this process has read through read(2)/pread(2) so far (Linux ``rchar``)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
@pytest.mark.parametrize("layout", ["hdf5-contiguous", "hdf5-chunked", "zarr-v3", "zarr-v2"])
def test_region_reads_fetch_only_the_region(tmp_path, layout):
    shape = (2, 64, 128, 128)  # two samples of 4 MiB
    sample_bytes = 4 * 64 * 128 * 128
    data = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    if layout.startswith("hdf5"):
        path = tmp_path / "big.h5"
        with h5py.File(path, "w") as f:
            chunks = (1, 16, 32, 32) if layout == "hdf5-chunked" else None
            f.create_dataset("x", data=data, chunks=chunks)
    else:
        path = tmp_path / "big.zarr"
        g = zarr.open_group(path, mode="w", zarr_format=int(layout[-1]))
        x = g.create_array("x", shape=shape, chunks=(1, 16, 32, 32), dtype="f4", compressors=None)
        x[:] = data
    region = (slice(2, 4), slice(10, 20), slice(30, 40))
    with open_dataset(str(path)) as r:
        r.read(0, "x", region)  # warm up: metadata and chunk indexes
        before = _bytes_read()
        got = r.read(1, "x", region)
        region_cost = _bytes_read() - before
        assert np.array_equal(got, data[1][region])
        before = _bytes_read()
        assert np.array_equal(r.read(1, "x"), data[1])
        whole_cost = _bytes_read() - before
    print(f"{layout}: region read {region_cost} bytes, whole sample {whole_cost} bytes")
    assert whole_cost >= sample_bytes
    assert region_cost < sample_bytes // 16, (region_cost, whole_cost)


def test_hdf5_file_open_elsewhere_in_the_process(tmp_path, arrays):
    """HDF5 refuses a second open with other access properties: the reader uses h5py's."""
    path = str(_hdf5(tmp_path, arrays, chunked=True).target)
    with open_dataset(path) as r, h5py.File(path, "r") as f:
        r.read(0, "y")
        assert np.array_equal(f["x"][1], r.read(1, "x"))


def test_hdf5_region_touches_only_its_chunks(tmp_path, arrays):
    """The chunks a region meets are the only ones the file must supply: deleting the others
    (by writing the file with only those chunks present) does not change the region."""
    path = tmp_path / "sparse.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("x", shape=(N, C, S, S, S), chunks=(1, C, 8, 8, 8), dtype="f4")
        ds[2, :, 8:16, 0:8, 8:16] = arrays["x"][2][:, 8:16, 0:8, 8:16]  # one chunk written
        assert ds.id.get_num_chunks() == 1
    region = (slice(1, 3), slice(9, 15), slice(2, 7), slice(8, 16))
    with open_dataset(str(path)) as r:
        assert np.array_equal(r.read(2, "x", region), arrays["x"][2][region])


# -- detection, specs and spec files ----------------------------------------------------------
def test_detect_globs_and_single_files(tmp_path, arrays):
    d = npy_dir(tmp_path, arrays["x"])
    spec = detect(str(d / "s*.npy"))
    assert (spec.format, spec.fields) == ("npy", (FieldSpec("data", X_AXES),))
    with open_dataset(spec) as r:
        assert len(r) == N and np.array_equal(r.read(3, "data"), arrays["x"][3])
    one = tmp_path / "one.h5"
    with h5py.File(one, "w") as f:
        f.create_dataset("vol", data=arrays["x"][0])  # (C, S, S, S): N = C samples of (S,S,S)
        f.create_dataset("grp/lab", data=arrays["y"][0])
        f.create_dataset("const", data=np.float32(1.5))  # 0-D: not a field
    spec = detect(str(one))
    assert spec.format == "hdf5"
    assert spec.fields == (FieldSpec("grp/lab", ()), FieldSpec("vol", (0, 1, 2)))
    with open_dataset(str(one)) as r:
        assert np.array_equal(r.read(1, "grp/lab", ()), arrays["y"][0][1])
        assert np.array_equal(
            r.read(3, "vol", (slice(2, 5),) * 3), arrays["x"][0][3, 2:5, 2:5, 2:5]
        )


def test_one_npy_file_named_by_itself_is_refused_not_read_as_one_sample(tmp_path):
    """``np.save("train.npy", x)`` of 10 samples, named by itself, was one sample: batches of
    ``(1, 10, 2, 4, 4, 4)``, ``len(loader.dataset)`` 1. A directory of one file is one sample."""
    x = np.zeros((10, 2, 4, 4, 4), np.float32)
    for name in ("train.npy", "train.npz"):
        (np.save if name.endswith("y") else np.savez)(tmp_path / name, x)
        with pytest.raises(DatasetError, match=rf"{name}: one \.npy/\.npz file is one sample, not"):
            detect(str(tmp_path / name))
    (tmp_path / "one").mkdir()
    np.save(tmp_path / "one" / "s.npy", x[0])
    with open_dataset(str(tmp_path / "one")) as r:
        assert len(r) == 1 and r.fields["data"].shape == (2, 4, 4, 4)


def test_spec_overrides_spatial_axes_and_sets_label(tmp_path, arrays):
    path = tmp_path / "cl.h5"
    cl = np.ascontiguousarray(np.moveaxis(arrays["x"], 1, -1))  # channels last (D, H, W, C)
    with h5py.File(path, "w") as f:
        f.create_dataset("full", data=cl)
        f.create_dataset("unitPar", data=arrays["y"])
    spec = DatasetSpec("hdf5", str(path), (FieldSpec("full", (0, 1, 2)), "unitPar"), "unitPar")
    with open_dataset(spec) as r:
        assert r.fields["full"].spatial_axes == (0, 1, 2)
        assert r.fields["unitPar"].spatial_axes == ()
        assert r.label == "unitPar"
        region = (slice(4, 12), slice(0, 16), slice(3, 5), slice(0, 4))
        assert np.array_equal(r.read(1, "full", region), cl[1][region])
    too_many = DatasetSpec("hdf5", str(path), (FieldSpec("unitPar", (0, 1)),))
    with pytest.raises(DatasetError, match=r"field 'unitPar': spatial axes \(0, 1\) do not fit"):
        open_dataset(too_many)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_spec_files(tmp_path, arrays, suffix):
    d = tmp_path / "data"
    d.mkdir()
    for i in range(N):
        np.savez(d / f"s{i}.npz", full=arrays["x"][i], unitPar=arrays["y"][i])
    if suffix == ".json":
        text = json.dumps(
            {
                "format": "npy",
                "paths": "data",
                "fields": [{"name": "full", "spatial_axes": [1, 2, 3]}, "unitPar"],
                "label": "unitPar",
            }
        )
    else:
        text = (
            'format = "npy"\npaths = ["data/*.npz"]\nlabel = "unitPar"\n'
            '[[fields]]\nname = "full"\nspatial_axes = [1, 2, 3]\n'
            '[[fields]]\nname = "unitPar"\n'
        )
    spec_path = tmp_path / f"spec{suffix}"
    spec_path.write_text(text)
    spec = DatasetSpec.load(spec_path)
    assert spec.fields == (FieldSpec("full", X_AXES), FieldSpec("unitPar"))
    assert spec.label == "unitPar"
    assert DatasetSpec.from_dict(spec.to_dict()) == spec
    with open_dataset(str(spec_path)) as r:
        assert np.array_equal(r.read(4, "full", X_REGIONS[2]), arrays["x"][4][X_REGIONS[2]])
    spec_path.write_text(text.replace("label", "labl"))
    with pytest.raises(DatasetError, match=r"spec\.(json|toml).*unknown key") as exc:
        DatasetSpec.load(spec_path)
    assert exc.value.path == str(spec_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"format": "parquet"}, "unknown format 'parquet'"),
        ({"paths": ()}, "at least one non-empty path"),
        ({"fields": ("x", "x")}, "field 'x': named twice"),
        ({"fields": ("x",), "label": "y"}, "field 'y': label is not among the fields"),
        ({"fields": (3,)}, "fields must be FieldSpec or names"),
    ],
)
def test_invalid_specs(kwargs, match):
    args = {"format": "hdf5", "paths": ("a.h5",), **kwargs}
    with pytest.raises(DatasetError, match=match):
        DatasetSpec(**args)


@pytest.mark.parametrize(
    ("axes", "match"),
    [((2, 1), "increasing"), ((-1, 0), "non-negative"), ((1.0,), "ints"), ("12", "ints")],
)
def test_invalid_field_specs(axes, match):
    with pytest.raises(DatasetError, match=f"field 'x': spatial_axes must be .*{match}"):
        FieldSpec("x", axes)
    assert FieldSpec("x", [np.int64(1), 2]).spatial_axes == (1, 2)  # normalized to a tuple


def test_normalize_region_is_exact():
    assert normalize_region(None, (3, 4)) == (slice(0, 3), slice(0, 4))
    assert normalize_region((slice(None, 2), slice(1, None)), (3, 4)) == (slice(0, 2), slice(1, 4))
    assert normalize_region((), ()) == ()
    assert normalize_region((slice(np.int64(1), np.int32(3)),), (3,)) == (slice(1, 3),)
    for bad in [(slice(0, 4),), [slice(0, 3)], (slice(0, 3), slice(0, 5))]:
        with pytest.raises(ValueError):
            normalize_region(bad, (3,) if len(bad) == 1 else (3, 4))


# -- malformed and mismatched data ------------------------------------------------------------
def test_missing_paths(tmp_path):
    for target in (str(tmp_path / "nope.h5"), str(tmp_path / "none-*.npy")):
        with pytest.raises(DatasetError, match=r"no such file|matches nothing") as exc:
            open_dataset(target)
        assert exc.value.path == target
    with pytest.raises(DatasetError, match="no such file") as exc:
        open_dataset(DatasetSpec("zarr", str(tmp_path / "gone.zarr")))
    assert str(tmp_path / "gone.zarr") in str(exc.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no dataset here"):
        detect(tmp_path / "empty")


def test_a_directory_of_class_subfolders_names_one_and_the_glob_of_them_all(tmp_path):
    """``data/a/*.npy`` and ``data/b/*.npy``: ``data`` was "no dataset here" with no word that
    subdirectories are not searched; the glob it now names reads every sample, a/ then b/."""
    for c, base in (("a", 0), ("b", 10)):
        (tmp_path / "data" / c).mkdir(parents=True)
        for i in range(2):
            np.save(tmp_path / "data" / c / f"{i}.npy", np.full(3, base + i, np.float32))
    (tmp_path / "data" / ".hidden").mkdir()
    with pytest.raises(DatasetError) as exc:
        open_dataset(str(tmp_path / "data"))
    d = tmp_path / "data"
    assert str(exc.value) == (
        f"{d}: no dataset here: no .h5/.hdf5/.npy/.npz/.tar files, no LMDB or zarr markers; "
        f"subdirectories are not searched, and {d}/a holds .npy files: name a glob of them "
        f"all, '{d}/*/*.npy', or one subdirectory"
    )
    with open_dataset(f"{d}/*/*.npy") as r:
        got = [r.read(i, "data").tolist() for i in range(len(r))]
    assert got == [[0.0] * 3, [1.0] * 3, [10.0] * 3, [11.0] * 3]


def test_truncated_and_garbage_hdf5(tmp_path, arrays):
    good = tmp_path / "good.h5"
    with h5py.File(good, "w") as f:
        f.create_dataset("x", data=arrays["x"])
    raw = good.read_bytes()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(raw[: len(raw) // 2])
    junk = tmp_path / "junk.h5"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    for path in (cut, junk):
        with pytest.raises(DatasetError, match="not a readable HDF5 file") as exc:
            open_dataset(str(path))
        assert exc.value.path == str(path)
        with pytest.raises(DatasetError, match="not a readable HDF5 file"):
            open_dataset(DatasetSpec("hdf5", str(path), (FieldSpec("x", X_AXES),)))


def test_truncated_and_garbage_npy(tmp_path, arrays):
    d = npy_dir(tmp_path, arrays["x"])
    raw = (d / "s3.npy").read_bytes()
    (d / "s3.npy").write_bytes(raw[:-100])
    (d / "s4.npy").write_bytes(b"\x93NUMPY garbage" + bytes(200))
    spec = DatasetSpec("npy", str(d), (FieldSpec("x", X_AXES),))
    with open_dataset(spec) as r:
        assert np.array_equal(r.read(2, "x"), arrays["x"][2])
        with pytest.raises(DatasetError, match=r"s3\.npy: field 'x': not a valid .npy.*truncated"):
            r.read(3, "x", X_REGIONS[0])
        with pytest.raises(DatasetError, match=r"s4\.npy: field 'x': not a valid .npy file"):
            r.read(4, "x")
    (d / "s0.npy").write_bytes(b"not numpy at all")
    with pytest.raises(DatasetError, match=r"s0\.npy: field 'data': not a valid .npy file"):
        open_dataset(str(d))


def test_a_malformed_npy_header_is_named(tmp_path, arrays):
    d = npy_dir(tmp_path, arrays["x"])
    raw = (d / "s1.npy").read_bytes()
    start = raw.index(b"'<f4'")  # a name where a literal belongs: what ast.literal_eval rejects
    (d / "s1.npy").write_bytes(raw[:start] + b"float" + raw[start + 5 :])
    with open_dataset(str(d)) as r, pytest.raises(DatasetError) as exc:
        r.read(1, "data")
    says = "field 'data': not a valid .npy file: its .npy header is malformed"
    assert str(exc.value) == f"{d / 's1.npy'}: {says}"


def test_samples_that_differ_from_sample_zero(tmp_path, arrays):
    d = tmp_path / "cosmo"
    d.mkdir()
    for i in range(3):
        with h5py.File(d / f"s{i}.h5", "w") as f:
            f.create_dataset("x", data=arrays["x"][i] if i != 2 else arrays["x"][i, :2])
            f.create_dataset("y", data=arrays["y"][i])
    with pytest.raises(DatasetError, match=r"s2\.h5: holds"):  # detection looks at the files
        open_dataset(str(d))
    with open_dataset(DatasetSpec("hdf5-per-sample", (str(d),))) as r:  # checked when read
        assert np.array_equal(r.read(1, "x"), arrays["x"][1])
        with pytest.raises(DatasetError, match=r"s2\.h5: field 'x': dataset <f4 \(2, 16"):
            r.read(2, "x", X_REGIONS[0])
    npz = tmp_path / "npz"
    npz.mkdir()
    np.savez(npz / "a.npz", x=arrays["x"][0], y=arrays["y"][0])
    np.savez(npz / "b.npz", x=arrays["x"][1].astype(np.float64), y=arrays["y"][1])
    np.savez(npz / "c.npz", x=arrays["x"][2])
    with open_dataset(str(npz)) as r:
        with pytest.raises(DatasetError, match=r"b\.npz: field 'x': sample 1 is <f8"):
            r.read(1, "x")
        with pytest.raises(DatasetError, match=r"c\.npz: field 'y': sample 2 has no such array"):
            r.read(2, "y")
    for k, n in enumerate((3, 2)):
        with h5py.File(tmp_path / f"sh{k}.h5", "w") as f:
            f.create_dataset("x", data=arrays["x"][:n])
            f.create_dataset("y", data=arrays["y"][: n + k])
    with pytest.raises(DatasetError, match=r"sh1\.h5: field 'y': has 3 samples but field 'x'"):
        open_dataset(DatasetSpec("hdf5", str(tmp_path / "sh*.h5")))


def test_npy_fortran_order_and_big_endian(tmp_path, arrays):
    d = tmp_path / "npy"
    d.mkdir()
    vols = [np.asfortranarray(arrays["x"][i]).astype(">f4") for i in range(N)]
    for i, v in enumerate(vols):
        np.save(d / f"s{i}.npy", v)
    with open_dataset(str(d)) as r:  # read in this machine's byte order
        assert r.fields["data"].dtype == np.dtype("=f4")
        assert r.stored["data"].dtype == np.dtype(">f4")
        for region in X_REGIONS:
            got = r.read(2, "data", region)
            assert got.dtype == np.dtype("=f4") and got.flags.c_contiguous
            assert np.array_equal(got, arrays["x"][2][region])
        with pytest.raises(DatasetError, match="dtype >f4 != field dtype <f4"):
            r.read(0, "data", out=np.empty((C, S, S, S), ">f4"))


def test_lmdb_readers_of_one_environment_share_it(tmp_path, arrays):
    path = tmp_path / "ds"
    write_lmdb(path, ({"x": arrays["x"][i]} for i in range(N)))
    a, b = open_dataset(str(path)), open_dataset(DatasetSpec("lmdb", str(path), ("x",)))
    assert np.array_equal(a.read(1, "x"), arrays["x"][1])
    assert np.array_equal(b.read(2, "x", X_REGIONS[3]), arrays["x"][2][X_REGIONS[3]])
    a.close()
    assert np.array_equal(b.read(3, "x"), arrays["x"][3])
    b.close()
    with open_dataset(str(path)) as c:
        assert np.array_equal(c.read(4, "x"), arrays["x"][4])


def test_malformed_lmdb(tmp_path, arrays):
    plain = tmp_path / "plain"
    env = lmdb.open(str(plain), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"00000000/x", b"1234")
    env.close()
    with pytest.raises(DatasetError, match=r"plain: no __meta__ record"):
        open_dataset(str(plain))
    with pytest.raises(DatasetError, match="not a readable LMDB"):
        open_dataset(DatasetSpec("lmdb", str(tmp_path)))  # a directory without data.mdb

    path = tmp_path / "ds"
    write_lmdb(path, ({"x": arrays["x"][i], "y": arrays["y"][i]} for i in range(2)))
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(sample_key(1, "y"), b"short")  # a record of the wrong size
        txn.delete(sample_key(1, "x"))
    env.close()
    with open_dataset(str(path)) as r:
        assert np.array_equal(r.read(0, "y"), arrays["y"][0])
        with pytest.raises(DatasetError, match=r"ds: field 'y': sample 1: record holds 5 bytes"):
            r.read(1, "y")
        with pytest.raises(DatasetError, match=r"ds: field 'x': no record for sample 1"):
            r.read(1, "x", X_REGIONS[1])
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(META_KEY))
        meta["fields"]["x"]["dtype"] = "not-a-dtype"
        txn.put(META_KEY, json.dumps(meta).encode())
    env.close()
    with pytest.raises(DatasetError, match=r"ds: field 'x': bad __meta__ entry"):
        open_dataset(str(path))


def test_write_lmdb_rejects_inconsistent_samples(tmp_path, arrays):
    samples = [{"x": arrays["x"][0], "y": arrays["y"][0]}, {"x": arrays["x"][1]}]
    with pytest.raises(DatasetError, match=r"sample 1 has fields \['x'\]"):
        write_lmdb(tmp_path / "a", samples)
    samples = [{"x": arrays["x"][0]}, {"x": arrays["x"][1, :2]}]
    with pytest.raises(DatasetError, match=r"field 'x': sample 1 is <f4 \(2, 16, 16, 16\)"):
        write_lmdb(tmp_path / "b", samples)
    write_lmdb(tmp_path / "c", [{"x": arrays["x"][0]}])
    with pytest.raises(FileExistsError):
        write_lmdb(tmp_path / "c", [{"x": arrays["x"][0]}])


def test_lmdb_grows_its_map_and_records_codecs(tmp_path):
    big = np.arange(300_000, dtype=np.float64).reshape(3, 100, 1000)  # 2.4 MB a sample
    path = tmp_path / "grow"
    write_lmdb(path, ({"v": big + i} for i in range(40)), codec={"v": None})  # 96 MB > 64 MiB
    with open_dataset(str(path)) as r:
        assert len(r) == 40 and r.fields["v"].spatial_axes == (0, 1, 2)
        assert r.codecs == {"v": None}
        assert np.array_equal(
            r.read(39, "v", (slice(1, 2), slice(7, 9), slice(0, 5))), big[1:2, 7:9, :5] + 39
        )


def test_malformed_tars(tmp_path, arrays):
    gz = tmp_path / "shard.tar"
    with tarfile.open(gz, "w:gz") as tf:
        _member(tf, "s.npy", _npy_bytes(arrays["x"][0]))
    with pytest.raises(DatasetError, match=r"shard\.tar: a gzip-compressed tar cannot be read"):
        open_dataset(DatasetSpec("tar", str(gz)))
    tgz = tmp_path / "shard.tar.gz"
    gz.rename(tgz)
    with pytest.raises(DatasetError, match=r"shard\.tar\.gz: a compressed tar"):
        detect(tgz)
    mixed = tmp_path / "mixed.tar"
    with tarfile.open(mixed, "w") as tf:
        _member(tf, "s0.npy", _npy_bytes(arrays["x"][0]))
        _member(tf, "s0.txt", b"a caption")
    with pytest.raises(DatasetError, match=r"mixed\.tar: member 's0\.txt': \.txt members are not"):
        open_dataset(str(mixed))
    cut = tmp_path / "cut.tar"
    with tarfile.open(cut, "w") as tf:
        for i in range(2):
            _member(tf, f"s{i}.npy", _npy_bytes(arrays["x"][i]))
    cut.write_bytes(cut.read_bytes()[:40_000])
    with pytest.raises(DatasetError, match=r"cut\.tar"):
        open_dataset(str(cut))


def test_broken_zarr(tmp_path):
    d = tmp_path / "bad.zarr"
    d.mkdir()
    (d / "zarr.json").write_text("{not json")
    with pytest.raises(DatasetError, match=r"bad\.zarr: not a readable zarr group"):
        open_dataset(str(d))
    arr = tmp_path / "arr.zarr"
    zarr.create_array(arr, shape=(2, 3), dtype="f4")
    with pytest.raises(DatasetError, match=r"arr\.zarr: a zarr array, not a group"):
        detect(arr)


# -- the command line -------------------------------------------------------------------------
def _inspect(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DATASTORE_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "datastore", "inspect", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_inspect_cli(tmp_path, arrays):
    path = str(_hdf5(tmp_path, arrays, chunked=True).target)
    text = _inspect(path)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"{path}: hdf5, 5 samples in 1 file(s), 320.1 KiB (327760 bytes)"
    assert lines[1].split() == [
        "field", "dtype", "shape", "(per", "sample)", "spatial", "axes", "chunks", "per", "sample"
    ]  # fmt: skip
    assert " ".join(lines[2].split()) == "x float32 (4, 16, 16, 16) (1, 2, 3) (4, 8, 8, 8) 64.0 KiB"
    assert " ".join(lines[3].split()) == "y float32 (4,) - - 16 B"

    lm = _lmdb(tmp_path, arrays, numcodecs.Zstd()).target
    out = _inspect(str(lm), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "path": str(lm),
        "format": "lmdb",
        "files": 1,
        "num_samples": N,
        "fields": {
            "x": {
                "dtype": "<f4",
                "shape": [C, S, S, S],
                "spatial_axes": [1, 2, 3],
                "chunks": None,
                "nbytes_per_sample": C * S**3 * 4,
            },
            "y": {
                "dtype": "<f4",
                "shape": [C],
                "spatial_axes": [],
                "chunks": None,
                "nbytes_per_sample": C * 4,
            },
        },
        "label": None,
        "nbytes": N * (C * S**3 + C) * 4,
    }


def test_inspect_cli_bad_input_exits_2_with_one_line(tmp_path, arrays):
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"\x00" * 1000)
    spec = tmp_path / "spec.json"
    _hdf5(tmp_path, arrays, chunked=False)
    spec.write_text(json.dumps({"format": "hdf5", "paths": "train.h5", "fields": ["x", "lab"]}))
    cases = {
        str(tmp_path / "missing.h5"): "missing.h5: no such file or directory",
        str(junk): "junk.h5: not a readable HDF5 file",
        str(spec): "train.h5: field 'lab': not in the data (it has: x, y)",
    }
    for target, message in cases.items():
        proc = _inspect(target, "--json")
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        err = proc.stderr.strip()
        assert "\n" not in err and "Traceback" not in err
        assert err.startswith("datastore inspect: error: ") and message in err, err


@pytest.mark.parametrize("fmt", ["hdf5", "zarr"])
def test_fields_leave_out_arrays_of_other_lengths(tmp_path, fmt):
    """An xarray/netCDF-style file holds coordinate arrays beside the samples: with
    ``fields=`` naming the samples' arrays the loader reads them (it refused, naming the field
    asked for and sending the user to a spec file)."""
    from datastore import DataStoreLoader

    x = np.arange(6 * 64, dtype=np.float32).reshape(6, 1, 4, 4, 4)
    y, depth = np.arange(6.0), np.linspace(0, 1, 4)
    if fmt == "hdf5":
        path = str(tmp_path / "f.h5")
        with h5py.File(path, "w") as f:
            f["x"], f["y"], f["depth"] = x, y, depth
    else:
        path = str(tmp_path / "g.zarr")
        group = zarr.open_group(path, mode="w")
        for name, a in (("x", x), ("y", y), ("depth", depth)):
            group.create_array(name, shape=a.shape, dtype=a.dtype)[...] = a
    named = open_dataset(path, fields=("x", "y"))
    assert [(f.name, f.spatial_axes) for f in named.fields.values()] == [
        ("x", (1, 2, 3)),
        ("y", ()),
    ]
    named.close()
    loader = DataStoreLoader(path, batch_size=3, fields=["x", "y"], shuffle=False)
    got = [(b["x"].numpy(), b["y"].numpy()) for b in loader]
    assert np.array_equal(np.concatenate([g[0] for g in got]), x)
    assert np.array_equal(np.concatenate([g[1] for g in got]), y)
    with pytest.raises(DatasetError) as exc:
        DataStoreLoader(path, batch_size=3)
    one_sample = ', or, if the file is one sample, say so (layout="per-sample")'
    assert str(exc.value) == (
        f"{path}: field 'x': has 6 samples but field 'depth' has 4; name the fields to read "
        "(fields=[...], or a spec's fields)" + (one_sample if fmt == "hdf5" else "")
    )


def test_fields_named_keep_the_spatial_axes_the_data_records(tmp_path):
    """Naming fields keeps the axes an LMDB's metadata records (channels-last here), not the
    default's (nor none, as a spec's bare name means)."""
    from datastore.readers import write_lmdb

    samples = [{"x": np.full((4, 4, 4, 2), i, np.float32), "y": np.arange(3.0)} for i in range(3)]
    write_lmdb(tmp_path / "db", samples, spatial_axes={"x": (0, 1, 2)})
    with open_dataset(str(tmp_path / "db"), fields=("x",)) as r:
        assert list(r.fields) == ["x"] and r.fields["x"].spatial_axes == (0, 1, 2)
    with open_dataset(str(tmp_path / "db")) as r:
        assert r.fields["x"].spatial_axes == (0, 1, 2) and r.fields["y"].spatial_axes == ()


def test_an_hdf5_file_open_for_writing_elsewhere_is_named_so(tmp_path):
    if os.environ.get("HDF5_USE_FILE_LOCKING", "").upper() == "FALSE":
        pytest.skip("HDF5_USE_FILE_LOCKING=FALSE: HDF5 takes no lock here")
    path = tmp_path / "w.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((4, 2))
    writer = subprocess.Popen(
        [sys.executable, "-c", f"import h5py, sys; f = h5py.File({str(path)!r}, 'a'); "
         "print('open', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert writer.stdout.readline() == "open\n"
        with pytest.raises(DatasetError) as exc:
            open_dataset(str(path))
        assert str(exc.value) == (
            f"{path}: another process has it open for writing (HDF5's file lock): read it "
            "once the writer has closed it"
        )
    finally:
        writer.communicate("", timeout=30)


def test_write_lmdb_stores_big_endian_arrays_in_this_machines_order(tmp_path):
    """The loader delivers native byte order only: write_lmdb stored a '>f4' array as is,
    which the loader then refused."""
    from datastore import DataStoreLoader
    from datastore.readers import write_lmdb

    x = np.arange(3 * 8, dtype=">f4").reshape(3, 8)
    write_lmdb(tmp_path / "db", ({"x": x[i], "n": np.int16(i).astype(">i2")} for i in range(3)))
    with open_dataset(str(tmp_path / "db")) as r:
        assert r.fields["x"].dtype == np.dtype("=f4") and r.fields["n"].dtype == np.dtype("=i2")
    got = next(iter(DataStoreLoader(str(tmp_path / "db"), batch_size=3, shuffle=False)))
    assert np.array_equal(got["x"].numpy(), x) and got["n"].tolist() == [0, 1, 2]


def test_inspect_lists_a_zarr_string_array(tmp_path):
    """numpy cannot parse ``StringDType()`` back from its string: ``datastore inspect`` of a
    group holding one ended in ``internal error: TypeError: data type 'StringDType()' not
    understood``."""
    from datastore.readers.inspect_cmd import describe, format_text

    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
    g.create_array("x", shape=(4, 3), dtype="f4")[:] = 1
    g.create_array("name", shape=(4,), dtype=str)[:] = np.array(["a", "b", "c", "d"])
    with open_dataset(str(tmp_path / "s.zarr")) as reader:
        lines = format_text(describe(reader, "s.zarr")).splitlines()
    assert [" ".join(line.split()) for line in lines[2:]] == [
        "name StringDType() () - - 16 B",
        "x float32 (3,) - (3,) 12 B",
    ]


@pytest.mark.parametrize("shards", [None, (2, 3)], ids=["chunked", "sharded"])
def test_inspect_shows_a_big_endian_zarr_3_array_as_stored(tmp_path, shards):
    """A format-3 array written with ``BytesCodec(endian="big")`` showed ``float32`` where a
    format-2 ``>f4`` array, HDF5 and npy show ``float32 (>f4)``; its values read as written."""
    from zarr.codecs import BytesCodec

    from datastore.readers.inspect_cmd import describe, format_text

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = zarr.open_group(str(tmp_path / "b.zarr"), mode="w", zarr_format=3)
    big = BytesCodec(endian="big")
    kw = {"chunks": (1, 3), "shards": shards}
    g.create_array("x", shape=(4, 3), dtype="f4", serializer=big, **kw)[:] = x
    g.create_array("n", shape=(4, 3), dtype="f4", **kw)[:] = x  # little: as is
    with open_dataset(str(tmp_path / "b.zarr")) as reader:
        lines = format_text(describe(reader, "b.zarr")).splitlines()
        got = [reader.read(i, "x") for i in range(4)]
    assert [" ".join(line.split()) for line in lines[2:]] == [
        "n float32 (3,) - (3,) 12 B",
        "x float32 (>f4) (3,) - (3,) 12 B",
    ]
    assert np.array_equal(np.stack(got), x) and got[0].dtype == np.dtype("=f4")


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_zarr_array_written_anew_after_opening_is_refused(tmp_path, zarr_format):
    """zarr keeps the metadata it read when the group was opened: an array written anew with
    int32 in place of float32 (same chunks) was decoded as float32, 7 coming back as 1e-44."""
    path = str(tmp_path / "g.zarr")

    def write(a):
        g = zarr.open_group(path, mode="w", zarr_format=zarr_format)
        g.create_array("x", shape=a.shape, dtype=a.dtype, chunks=(1, 8), compressors=None)[:] = a

    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    write(x)
    reader = open_dataset(path)
    assert np.array_equal(reader.read(2, "x"), x[2])
    write(x.astype(np.int32) + 7)
    with pytest.raises(DatasetError, match=r"field 'x': the array changed since the dataset"):
        reader.read(2, "x")


def _reader_of_fifo(fifo: Path, stop: threading.Event) -> None:
    """Open ``fifo`` for writing whenever a reader has it open, then close it: a read that
    should never have opened it ends (at end of file) instead of blocking for ever."""
    while not stop.is_set():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            stop.wait(0.05)


def _virtual(path, sources, n=4):
    """A virtual dataset ``x`` at ``path``: ``n`` float32 of each of ``sources`` in turn."""
    layout = h5py.VirtualLayout((n * len(sources),), np.float32)
    for k, source in enumerate(sources):
        layout[k * n : (k + 1) * n] = h5py.VirtualSource(source, "x", shape=(n,))
    with h5py.File(path, "w") as f:
        f.create_virtual_dataset("x", layout)


def test_hdf5_virtual_sources_found_nowhere_are_refused(tmp_path, monkeypatch):
    """A virtual dataset whose source is in none of the places HDF5 looks for it was read as
    its fill value: ``[1] * 4 + [0] * 8`` for ``[1] * 4 + [2] * 8``, without a word. It is
    refused when opened (a file of a set of one sample per file: when read), naming the file,
    the dataset and the source; once the source is there it is read."""
    data, cwd = tmp_path / "data", tmp_path / "cwd"
    data.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("HDF5_VDS_PREFIX", raising=False)
    with h5py.File(data / "a.h5", "w") as f:
        f["x"] = np.ones(4, np.float32)
    _virtual(data / "vds.h5", ["a.h5", "b.h5", "b.h5"])
    _virtual(data / "one.h5", ["a.h5"])
    _virtual(data / "two.h5", ["b.h5"])

    def missing(name):
        return (
            f"{data / name}: field 'x': its virtual source 'b.h5' is in none of the places "
            f"HDF5 looks for it ({data / 'b.h5'}, {cwd / 'b.h5'}): HDF5 would read its samples "
            "as the fill value; put the file there (or set HDF5_VDS_PREFIX to its directory)"
        )

    with pytest.raises(DatasetMissing) as err:
        open_dataset(str(data / "vds.h5"))
    assert str(err.value) == missing("vds.h5")
    spec = DatasetSpec("hdf5-per-sample", (str(data / "one.h5"), str(data / "two.h5")))
    with open_dataset(spec) as r, pytest.raises(DatasetMissing) as err:
        r.read(1, "x")
    assert str(err.value) == missing("two.h5")
    with h5py.File(data / "b.h5", "w") as f:
        f["x"] = np.full(4, 2, np.float32)
    with open_dataset(str(data / "vds.h5")) as r:
        assert [float(r.read(i, "x")) for i in range(len(r))] == [1] * 4 + [2] * 8


def test_hdf5_virtual_sources_lacking_or_unlike_their_dataset_are_refused(tmp_path, monkeypatch):
    """A virtual dataset whose source file is there but lacks the mapped dataset was read as
    the fill value (zeros, as h5py reads it), one whose source holds it of another shape as
    zeros or other elements, of another dtype converted: each is refused when opened, naming
    the file, the field, the source file and its dataset, each source file opened once."""
    monkeypatch.chdir(tmp_path)
    with h5py.File("a.h5", "w") as f:
        f["x"] = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
        f["y"] = np.ones((4, 3), np.float32)
    with h5py.File("b.h5", "w") as f:
        f["w"] = np.arange(12, dtype=np.float32).reshape(4, 3)
        f["x"] = np.ones((6, 2), np.float32)  # as many elements as (4, 3)
        f["z"] = np.ones((2, 3), np.float32)  # rows 2..3 of it mapped
        f["i"] = np.arange(12, dtype=np.int64).reshape(4, 3)  # converted, as h5py reads it
        f["s"] = np.full((4, 3), b"ab", "S2")

    def virtual(name, dataset, shape=(4, 3), rows=None):
        layout = h5py.VirtualLayout((8, 3), np.float32)
        layout[:4] = h5py.VirtualSource("a.h5", "x", shape=(4, 3))
        source = h5py.VirtualSource("b.h5", dataset, shape=shape)
        layout[4:] = source if rows is None else source[rows]
        with h5py.File(name, "w") as f:
            f.create_virtual_dataset("x", layout, fillvalue=0)
        return name

    lacks = virtual("lacks.h5", "v")
    with h5py.File(lacks) as f:
        assert not f["x"][4:].any()  # HDF5's fill value
    where = f"its virtual source 'b.h5' ({tmp_path / 'b.h5'})"
    refused = {
        lacks: f"{where} has no dataset 'v': HDF5 would read its samples as the fill value",
        virtual("shape.h5", "x"): (
            f"{where} holds 'x' as float32 (6, 2), not the (4, 3) the virtual dataset maps from it"
        ),
        virtual("rows.h5", "z"): (
            f"{where} holds 'z' as float32 (2, 3), not the (4, 3) the virtual dataset maps from it"
        ),
        virtual("slab.h5", "z", (6, 3), slice(2, 6)): (
            f"{where} holds 'z' as float32 (2, 3), too small for the selection up to (6, 3) "
            "mapped from it"
        ),
        virtual("dtype.h5", "s"): (
            f"{where} holds 's' as |S2 (4, 3), which HDF5 cannot convert to the field's float32"
        ),
    }
    for name, reason in refused.items():
        with pytest.raises(DatasetError) as err:
            open_dataset(name)
        assert str(err.value) == f"{name}: field 'x': {reason}"
    with pytest.raises(DatasetMissing):  # (NOT_FOUND through the service)
        open_dataset(lacks)
    with h5py.File(virtual("int64.h5", "i")) as f, open_dataset("int64.h5") as r:
        assert r.read(5, "x").tolist() == f["x"][5].tolist() == [3.0, 4.0, 5.0]
    layout = h5py.VirtualLayout((12, 3), np.float32)
    for k, (source, name) in enumerate([("a.h5", "x"), ("a.h5", "y"), ("b.h5", "w")]):
        layout[4 * k : 4 * k + 4] = h5py.VirtualSource(source, name, shape=(4, 3))
    with h5py.File("fine.h5", "w") as f:
        f.create_virtual_dataset("x", layout)
    opened, real_file = [], h5py.File
    monkeypatch.setattr(h5py, "File", lambda p, *a, **k: opened.append(p) or real_file(p, *a, **k))
    with open_dataset(DatasetSpec("hdf5", ("fine.h5",))) as r:  # (a path: detected, then opened)
        assert [p for p in opened if p != "fine.h5"] == [
            str(tmp_path / "a.h5"),
            str(tmp_path / "b.h5"),
        ]
        assert r.read(8, "x").tolist() == [0, 1, 2] and r.read(0, "x").tolist() == [1, 2, 3]


def test_hdf5_virtual_source_that_is_no_hdf5_file_is_refused_at_open(tmp_path, monkeypatch):
    """A virtual dataset whose source file is there but no HDF5 file was opened fine, and its
    first read failed (``OSError: Can't synchronously read data (file signature not
    found)``). It is refused when opened, naming the file, the field and the source."""
    monkeypatch.chdir(tmp_path)
    Path("a.h5").write_bytes(b"not HDF5\n" * 64)
    _virtual(tmp_path / "v.h5", ["a.h5"])
    with pytest.raises(DatasetError) as err:
        open_dataset("v.h5")
    assert str(err.value) == (
        f"v.h5: field 'x': its virtual source 'a.h5' ({tmp_path / 'a.h5'}): not a readable "
        "HDF5 file: Unable to synchronously open file (file signature not found)"
    )


def test_open_dataset_of_a_path_builds_one_reader(tmp_path, monkeypatch):
    """``open_dataset(path)`` built the reader twice (``detect``'s, then one of the spec it
    found): a virtual dataset's source file was opened twice per open, the file itself three
    times. Now one reader: the source once, the file twice (its layout attribute read first);
    the reader's spec is ``detect``'s."""
    monkeypatch.chdir(tmp_path)
    with h5py.File("a.h5", "w") as f:
        f["x"] = np.arange(4, dtype=np.float32)
    _virtual(tmp_path / "v.h5", ["a.h5", "a.h5"])
    opened, real_file = [], h5py.File
    monkeypatch.setattr(h5py, "File", lambda p, *a, **k: opened.append(p) or real_file(p, *a, **k))
    with open_dataset("v.h5") as r:
        assert sorted(map(str, opened)) == [str(tmp_path / "a.h5"), "v.h5", "v.h5"]
        assert r.read(5, "x") == 1.0
        assert r.spec == DatasetSpec("hdf5", ("v.h5",), (FieldSpec("x", ()),)) == detect("v.h5")


def test_hdf5_fields_reaching_a_fifo_are_refused_never_opened(tmp_path):
    """An external link, external storage or a virtual dataset's source naming a FIFO: HDF5
    opened it and blocked the whole process (h5py holds the GIL; a service stopped answering
    `datastore status`), whatever the loader's timeout."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with h5py.File(tmp_path / "link.h5", "w") as f:
        f["x"] = h5py.ExternalLink(str(fifo), "/x")
        f["y"] = np.zeros(4, np.float32)
    with h5py.File(tmp_path / "raw.h5", "w") as f:
        f.create_dataset("x", (4,), np.float32, external=[(str(fifo), 0, 16)])
    with h5py.File(tmp_path / "virtual.h5", "w") as f:
        layout = h5py.VirtualLayout((4,), np.float32)
        layout[:] = h5py.VirtualSource(str(fifo), "x", shape=(4,))
        f.create_virtual_dataset("x", layout)
    stop = threading.Event()
    unblock = threading.Thread(target=_reader_of_fifo, args=(fifo, stop), daemon=True)
    unblock.start()
    refused = f"reads {str(fifo)!r}, not a regular file (a FIFO, socket, device or directory)"
    try:
        with pytest.raises(DatasetError) as err:
            open_dataset(DatasetSpec("hdf5", (str(tmp_path / "link.h5"),), ("x", "y")))
        assert str(err.value) == f"{tmp_path / 'link.h5'}: field 'x': {refused}"
        with pytest.raises(DatasetError) as err:  # every dataset, those behind links included
            open_dataset(str(tmp_path / "link.h5"))
        assert str(err.value) == f"{tmp_path / 'link.h5'}: field 'x': {refused}"
        for name in ("raw.h5", "virtual.h5"):
            with open_dataset(str(tmp_path / name)) as r, pytest.raises(DatasetError) as err:
                r.read(0, "x", out=np.empty((), np.float32))
            assert str(err.value) == f"{tmp_path / name}: field 'x': {refused}"
    finally:
        stop.set()
        unblock.join()

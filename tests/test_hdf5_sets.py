"""Sets of HDF5 files: shards with a sample axis (``part-000.h5``...) are read as one dataset,
not as one sample per file (issue 11, trap 2); ``datastore inspect`` looks at every file."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from datastore import DataStoreLoader
from datastore.order import Schedule
from datastore.readers import open_dataset
from datastore.readers.base import DatasetError
from datastore.readers.spec import detect

COUNTS = (4, 5, 3)


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((sum(COUNTS), 2, 4, 4, 4), dtype=np.float32)
    y = rng.standard_normal((sum(COUNTS), 3), dtype=np.float32)
    d = tmp_path / "set"
    d.mkdir()
    at = 0
    for k, n in enumerate(COUNTS):
        with h5py.File(d / f"part-{k:03d}.h5", "w") as f:
            f["x"], f["y"] = x[at : at + n], y[at : at + n]
        at += n
    return d, x, y


def inspect(path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "datastore", "inspect", "--json", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_a_set_of_shards_is_one_dataset_sample_for_sample(shards):
    d, x, y = shards
    for path in (str(d), str(d / "part-*.h5")):
        assert detect(path).format == "hdf5"
        with open_dataset(path) as r:
            assert len(r) == sum(COUNTS) and r.fields["x"].shape == (2, 4, 4, 4)
            for i in range(len(r)):
                assert r.read(i, "x").tobytes() == x[i].tobytes()
                assert r.read(i, "y").tobytes() == y[i].tobytes()
            region = (slice(None), slice(1, 3), slice(0, 4), slice(2, 4))
            for i in (3, 4, 8, 9, 11):  # the last and first samples of the shards
                assert np.array_equal(r.read(i, "x", region), x[i][region])


def test_the_loader_reads_a_shard_set_whole(shards):
    d, x, _ = shards
    loader = DataStoreLoader(str(d), batch_size=3, seed=2)
    order = Schedule(sum(COUNTS), 3, seed=2).order(0)
    got = np.concatenate([b["x"].numpy() for b in loader])
    assert got.tobytes() == x[order].tobytes()


def test_inspect_counts_every_file_of_the_set(shards):
    d, x, y = shards
    proc = inspect(d)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert (s["format"], s["files"], s["num_samples"]) == ("hdf5", 3, 12)
    assert s["nbytes"] == x.nbytes + y.nbytes


def test_a_file_that_fits_neither_layout_is_named(shards):
    d, _, _ = shards
    with h5py.File(d / "part-001.h5", "w") as f:  # trailing shape differs
        f["x"] = np.zeros((5, 2, 4, 4, 5), np.float32)
        f["y"] = np.zeros((5, 3), np.float32)
    with pytest.raises(DatasetError, match=r"part-001\.h5"):
        open_dataset(str(d))
    proc = inspect(d)
    assert proc.returncode == 2 and "part-001.h5" in proc.stderr


def test_inspect_looks_at_the_files_detection_skips(tmp_path):
    """20 one-sample files: detection looks at 16; inspect at all, and names the odd one."""
    d = tmp_path / "cosmo"
    d.mkdir()
    for i in range(20):
        with h5py.File(d / f"s{i:02d}.h5", "w") as f:
            f["x"] = np.zeros((4, 4, 4, 4) if i != 7 else (4, 4, 4, 3), np.float32)
            f["y"] = np.zeros(4, np.float32)
    with open_dataset(str(d)) as r:
        assert r.format == "hdf5-per-sample" and len(r) == 20
    proc = inspect(d)
    assert proc.returncode == 2 and "s07.h5" in proc.stderr

"""Equal-size HDF5 shards are never read as one sample each by a guess (issue 22, 2b): a set
of files whose shapes cannot tell shards from samples is refused, naming the set and the one
argument that states it; an attribute our writers set, or the argument, decides."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from datastore import DataStoreLoader
from datastore.readers import DatasetSpec, open_dataset
from datastore.readers.base import DatasetError
from datastore.readers.spec import detect
from datastore.sources.options import ServiceOptions
from trainer.cosmology import write_dataset

FILES, PER_FILE, SHAPE = 4, 16, (4, 8, 8, 8)


def write_shards(d, attr=None):
    """``FILES`` files of ``PER_FILE`` samples: ``x`` (16, 4, 8, 8, 8) whose first element is
    the global index, ``y`` (16, 3); with ``attr``, each says ``datastore_layout = attr``."""
    d.mkdir()
    for k in range(FILES):
        x = np.zeros((PER_FILE, *SHAPE), np.float32)
        x[:, 0, 0, 0, 0] = np.arange(k * PER_FILE, (k + 1) * PER_FILE)
        with h5py.File(d / f"part-{k}.h5", "w") as f:
            f["x"], f["y"] = x, np.ones((PER_FILE, 3), np.float32)
            if attr is not None:
                f.attrs["datastore_layout"] = attr
    return d


def inspect(*args):
    cmd = [sys.executable, "-m", "datastore", "inspect", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_equal_shards_are_refused_naming_the_set_and_the_argument(tmp_path):
    d = write_shards(tmp_path / "parts")
    want = (
        f"{d}: 4 HDF5 files of identical shapes (x <f4 (16, 4, 8, 8, 8), y <f4 (16, 3)): each "
        "could be one sample, or a shard of 16 samples along axis 0, and no file says which; "
        'state it with layout="shards" or layout="per-sample"'
    )
    with pytest.raises(DatasetError) as exc:
        detect(d)
    assert str(exc.value).startswith(want), exc.value
    with pytest.raises(DatasetError) as exc:
        DataStoreLoader(str(d), batch_size=8)
    assert str(exc.value).startswith(want), exc.value
    proc = inspect(d)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith(f"datastore inspect: error: {want}"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_layout_shards_reads_every_sample_with_its_own_shape(tmp_path):
    d = write_shards(tmp_path / "parts")
    with DataStoreLoader(str(d), batch_size=8, layout="shards", shuffle=False) as loader:
        assert len(loader) == FILES * PER_FILE // 8
        seen = []
        for batch in loader:
            assert tuple(batch["x"].shape) == (8, *SHAPE) and tuple(batch["y"].shape) == (8, 3)
            seen += batch["x"][:, 0, 0, 0, 0].int().tolist()
    assert seen == list(range(64))
    proc = inspect(d, "--layout", "shards", "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert (s["format"], s["files"], s["num_samples"]) == ("hdf5", 4, 64)
    assert s["fields"]["x"]["shape"] == list(SHAPE)


def test_layout_per_sample_reads_one_sample_per_file(tmp_path):
    d = write_shards(tmp_path / "parts")
    with open_dataset(str(d), layout="per-sample") as r:
        assert (r.format, len(r), r.fields["x"].shape) == ("hdf5-per-sample", 4, (16, *SHAPE))


def test_an_attribute_in_the_files_decides(tmp_path):
    with open_dataset(str(write_shards(tmp_path / "s", "shards"))) as r:
        assert (r.format, len(r)) == ("hdf5", 64)
    with open_dataset(str(write_shards(tmp_path / "p", "per-sample"))) as r:
        assert (r.format, len(r)) == ("hdf5-per-sample", 4)
    odd = write_shards(tmp_path / "odd", "shards")
    with h5py.File(odd / "part-2.h5", "a") as f:
        f.attrs["datastore_layout"] = "per-sample"
    with pytest.raises(DatasetError, match=r"part-2\.h5: attribute datastore_layout='per-sample'"):
        detect(odd)


def test_trainer_per_sample_files_are_read_as_samples(tmp_path):
    """``trainer.cosmology --per-sample`` (x (4, S, S, S), y (3,)): no shared leading length,
    and the files say per-sample; a layout that contradicts the shapes is refused by name."""
    d = tmp_path / "train"
    write_dataset(d, 5, 4, seed=0, per_sample=True)
    with DataStoreLoader(str(d), batch_size=5, shuffle=False) as loader:
        (batch,) = list(loader)
        assert tuple(batch["x"].shape) == (5, 4, 4, 4, 4) and tuple(batch["y"].shape) == (5, 3)
    with pytest.raises(DatasetError, match=r"sample-00000\.h5: field 'y': .* 3 samples but"):
        open_dataset(str(d), layout="shards")


def test_a_bad_or_misplaced_layout_is_refused(tmp_path):
    d = write_shards(tmp_path / "parts")
    with pytest.raises(DatasetError, match=r"layout must be one of 'shards', 'per-sample'"):
        open_dataset(str(d), layout="shard")
    with pytest.raises(DatasetError, match=r"layout='shards' beside a spec of format 'hdf5'"):
        open_dataset(DatasetSpec("hdf5", (str(d),)), layout="shards")
    np.save(tmp_path / "a.npy", np.zeros(3))
    with pytest.raises(DatasetError, match=r"layout= is for HDF5 files; these are npy"):
        open_dataset(str(tmp_path / "a.npy"), layout="shards")


def test_a_layout_for_the_service_is_refused_with_what_to_do(tmp_path):
    d = write_shards(tmp_path / "parts")
    with pytest.raises(ValueError, match=r"layout= is for the embedded store: with service=, name"):
        DataStoreLoader(
            str(d), batch_size=8, layout="shards", service=ServiceOptions(str(tmp_path / "no.sock"))
        )

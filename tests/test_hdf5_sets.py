"""Sets of HDF5 files: shards with a sample axis (``part-000.h5``...) are read as one dataset,
not as one sample per file (issue 11, trap 2); ``datastore inspect`` looks at every file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import MPIEXEC, stage_sharded

from datastore import DataStoreLoader
from datastore.maths.order import Schedule
from datastore.readers import DatasetSpec, FieldSpec, open_dataset
from datastore.readers.base import DatasetError
from datastore.readers.spec import detect
from datastore.store.shards import LocalView, local_files, owners_by_holders, plan_shards
from staging.progress import human_bytes

COUNTS = (4, 5, 3)
REGION = (slice(None), slice(1, 3), slice(0, 4), slice(2, 4))
JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "h5shard_job.py")


def write_set(d, counts, seed=5, trailing=(2, 4, 4, 4)):
    """``d/part-{k:03d}.h5`` holding ``x`` (n, *trailing) float32, ``y`` (n, 3) float32 and
    ``idx`` (n,) int64 (the global index); file 0 contiguous, 1 chunked, 2 gzip (h5py reads).
    Returns the whole arrays."""
    rng = np.random.default_rng(seed)
    total = sum(counts)
    x = rng.standard_normal((total, *trailing), dtype=np.float32)
    y = rng.standard_normal((total, 3), dtype=np.float32)
    d.mkdir(exist_ok=True)
    at = 0
    for k, n in enumerate(counts):
        store = [{}, {"chunks": (1, *trailing)}, {"chunks": (1, *trailing), "compression": "gzip"}]
        with h5py.File(d / f"part-{k:03d}.h5", "w") as f:
            f.create_dataset("x", data=x[at : at + n], **store[k % 3])
            f["y"], f["idx"] = y[at : at + n], np.arange(at, at + n, dtype=np.int64)
        at += n
    return {"x": x, "y": y, "idx": np.arange(total, dtype=np.int64)}


@pytest.fixture
def shards(tmp_path):
    d = tmp_path / "set"
    return d, write_set(d, COUNTS)


def inspect(path, *flags) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "datastore", "inspect", *flags, str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


# -- one dataset, sample for sample --------------------------------------------------------------
def test_a_set_of_shards_is_one_dataset_sample_for_sample(shards):
    d, a = shards
    for path in (str(d), str(d / "part-*.h5")):
        assert detect(path).format == "hdf5"
        with open_dataset(path) as r:
            assert len(r) == sum(COUNTS) and r.fields["x"].shape == (2, 4, 4, 4)
            assert r.offsets.tolist() == [0, 4, 9, 12] and r.offsets.dtype == np.int64
            assert r.nbytes == sum(v.nbytes for v in a.values())
            for i in range(len(r)):
                for name, want in a.items():
                    assert r.read(i, name).tobytes() == want[i].tobytes()


def test_region_reads_into_out_across_the_files(shards):
    d, a = shards
    with open_dataset(str(d)) as r:
        out = np.empty((2, 2, 4, 2), np.float32)
        for i in range(len(r)):  # contiguous, chunked and gzip files alike
            assert r.read(i, "x", REGION, out=out) is out
            assert out.tobytes() == a["x"][i][REGION].tobytes()
            y = np.empty(2, np.float32)
            r.read(i, "y", (slice(1, 3),), out=y)
            assert y.tobytes() == a["y"][i, 1:3].tobytes()
        with pytest.raises(DatasetError, match=r"part-002\.h5: field 'x': out buffer"):
            r.read(10, "x", REGION, out=np.empty((2, 2, 4, 3), np.float32))
        with pytest.raises(DatasetError, match=r"index 12 out of range \[0, 12\)"):
            r.read(12, "x")


def test_the_loader_reads_a_shard_set_whole(shards):
    d, a = shards
    loader = DataStoreLoader(str(d), batch_size=3, seed=2)
    order = Schedule(sum(COUNTS), 3, seed=2).order(0)
    batches = list(loader)
    assert len(batches) == 4
    for name in ("x", "y", "idx"):
        got = np.concatenate([b[name].numpy() for b in batches])
        assert got.tobytes() == a[name][order].tobytes()


# -- what is refused, naming the file ------------------------------------------------------------
def _odd_x_dtype(f):
    f["x"], f["y"] = np.zeros((5, 2, 4, 4, 4)), np.zeros((5, 3), np.float32)
    f["idx"] = np.arange(4, 9)


def _odd_missing_y(f):
    f["x"], f["idx"] = np.zeros((5, 2, 4, 4, 4), np.float32), np.arange(4, 9)


def _odd_trailing(f):
    f["x"], f["y"] = np.zeros((5, 2, 4, 4, 5), np.float32), np.zeros((5, 3), np.float32)
    f["idx"] = np.arange(4, 9)


def _odd_counts(f):
    f["x"], f["y"] = np.zeros((5, 2, 4, 4, 4), np.float32), np.zeros((4, 3), np.float32)
    f["idx"] = np.arange(4, 9)


def _odd_one_sample_file(f):  # no sample axis: a per-sample file among shards
    f["x"], f["y"] = np.zeros((2, 4, 4, 4), np.float32), np.zeros(3, np.float32)
    f["idx"] = np.arange(4, 9)


ODD = [_odd_x_dtype, _odd_missing_y, _odd_trailing, _odd_counts, _odd_one_sample_file]


@pytest.mark.parametrize("odd", ODD, ids=lambda f: f.__name__[5:])
def test_a_file_that_fits_neither_layout_is_named(tmp_path, odd):
    d = tmp_path / "set"
    write_set(d, COUNTS)
    with h5py.File(d / "part-001.h5", "w") as f:
        odd(f)
    for path in (str(d), str(d / "part-*.h5")):
        with pytest.raises(DatasetError, match=r"part-001\.h5"):
            open_dataset(path)
    with pytest.raises(DatasetError, match=r"part-001\.h5"):  # a spec says shards: checked too
        open_dataset(DatasetSpec("hdf5", (str(d),), ("x", "y")))
    if odd in (_odd_x_dtype, _odd_one_sample_file):  # the CLI says so too
        proc = inspect(d)
        assert proc.returncode == 2 and "part-001.h5" in proc.stderr, proc.stderr
        assert proc.stdout == "" and "Traceback" not in proc.stderr


# -- datastore inspect ---------------------------------------------------------------------------
def test_inspect_counts_every_file_of_the_set(shards):
    d, a = shards
    proc = inspect(d, "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert (s["format"], s["files"], s["num_samples"]) == ("hdf5", 3, 12)
    assert s["nbytes"] == sum(v.nbytes for v in a.values())
    text = inspect(d / "part-*.h5")
    assert text.returncode == 0, text.stderr
    nbytes = sum(v.nbytes for v in a.values())
    first = text.stdout.splitlines()[0]
    size = human_bytes(nbytes)
    assert first == f"{d / 'part-*.h5'}: hdf5, 12 samples in 3 file(s), {size} ({nbytes} bytes)"
    assert "note:" not in text.stdout


def _cosmo(d, n, odd=None, odd_x=(4, 4, 4, 3), odd_y=(4,), x=(4, 4, 4, 4), meta=False):
    """``n`` one-sample files ``s{i:02d}.h5``: x (4, 4, 4, 4), y (4,); file ``odd`` has
    ``odd_x`` and ``odd_y``; with ``meta``, a dataset whose length differs from file to file."""
    d.mkdir()
    for i in range(n):
        with h5py.File(d / f"s{i:02d}.h5", "w") as f:
            f["x"] = np.full(x if i != odd else odd_x, i, np.float32)
            f["y"] = np.full((4,) if i != odd else odd_y, i, np.float32)
            if meta:
                f["meta"] = np.zeros(i + 1, np.int8)
    return d


def test_inspect_looks_at_the_files_detection_skips(tmp_path):
    """20 one-sample files: detection looks at 16 (files 2, 7, 12 and 17 are skipped); inspect
    looks at every one and names the odd one."""
    odd = _cosmo(tmp_path / "odd", 20, odd=7)  # x (4, 4, 4, 3)
    spec = DatasetSpec("hdf5-per-sample", (str(odd),), (FieldSpec("x", (1, 2, 3)), "y"))
    with open_dataset(spec) as r:
        assert r.format == "hdf5-per-sample" and len(r) == 20
    proc = inspect(odd, "--layout", "per-sample")  # x (4, ...), y (4,): could be shards
    assert proc.returncode == 2 and "s07.h5" in proc.stderr, proc.stderr
    # an unseen file with another leading length: shard-like, not one sample like the rest
    shardlike = _cosmo(tmp_path / "shardlike", 20, odd=12, odd_x=(3, 4, 4, 4), odd_y=(3,))
    (shardlike / "spec.json").write_text(
        json.dumps({"format": "hdf5-per-sample", "paths": ".", "fields": ["x", "y"]})
    )
    for target in ((shardlike, "--layout", "per-sample"), (shardlike / "spec.json",)):
        proc = inspect(*target)
        assert proc.returncode == 2 and "s12.h5: field 'x'" in proc.stderr, proc.stderr


def test_inspect_checks_the_fields_a_spec_selects(tmp_path):
    """``meta`` differs from file to file; a spec that leaves it out reads, and inspect agrees."""
    d = _cosmo(tmp_path / "cosmo", 5, meta=True)
    with pytest.raises(DatasetError, match=r"s01\.h5: holds meta \|i1 \(2,\)"):
        open_dataset(str(d))  # detection looks at every dataset
    (d / "spec.json").write_text(
        json.dumps({"format": "hdf5-per-sample", "paths": ".", "fields": ["x", "y"]})
    )
    proc = inspect(d / "spec.json", "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert (s["format"], s["files"], s["num_samples"], s["nbytes"]) == (
        "hdf5-per-sample", 5, 5, 5 * (256 + 4) * 4
    )  # fmt: skip


def test_equal_shards_are_read_as_shards_only_when_stated(tmp_path):
    """Equal shard sizes cannot be told from one sample per file by their shapes: detection
    refuses them (tests/test_loader_layout.py), a spec with format hdf5 reads shards, and files
    whose datasets share no leading length are one sample each."""
    d = tmp_path / "equal"
    a = write_set(d, (4, 4, 4))
    text = inspect(d)
    assert text.returncode == 2 and 'layout="shards"' in text.stderr, text.stderr
    with open_dataset(DatasetSpec("hdf5", (str(d),))) as r:
        assert len(r) == 12 and r.offsets.tolist() == [0, 4, 8, 12]
        for i in range(12):
            assert r.read(i, "x").tobytes() == a["x"][i].tobytes()
    (d / "spec.toml").write_text('format = "hdf5"\npaths = ["."]\n')
    text = inspect(d / "spec.toml")
    assert text.returncode == 0 and "hdf5, 12 samples in 3 file(s)" in text.stdout
    channels_last = _cosmo(tmp_path / "cl", 3, x=(8, 8, 8, 4))  # no shared leading length
    text = inspect(channels_last)
    assert text.returncode == 0 and "hdf5-per-sample, 3 samples" in text.stdout


@pytest.mark.parametrize("stated", ["per-sample", "shards", None])
def test_one_file_is_read_as_the_layout_it_states(tmp_path, stated):
    """A per-sample set of one file (``trainer.cosmology --per-sample --samples 1``, or a node's
    share of one) was read as a shard whatever its ``datastore_layout`` said: x (4, 8, 8, 8)
    came as 4 samples of (8, 8, 8)."""
    x = np.arange(4 * 8**3, dtype=np.float32).reshape(4, 8, 8, 8)
    (tmp_path / "d").mkdir()
    with h5py.File(tmp_path / "d" / "sample-00000.h5", "w") as f:
        f["x"], f["y"] = x, np.arange(4, dtype=np.float32)
        if stated:
            f.attrs["datastore_layout"] = stated
    with open_dataset(str(tmp_path / "d")) as r:
        if stated == "per-sample":
            assert (r.format, len(r), r.fields["x"].shape) == ("hdf5-per-sample", 1, (4, 8, 8, 8))
            assert r.read(0, "x").tobytes() == x.tobytes()
        else:
            assert (r.format, len(r), r.fields["x"].shape) == ("hdf5", 4, (8, 8, 8))


def test_files_stating_one_sample_each_with_one_of_another_length_name_it(tmp_path):
    """Four files stating ``datastore_layout="per-sample"``, x (8, 4, 4), the third x (7, 4, 4):
    read as shards, 31 samples of (4, 4), without a word; now the third file is named."""
    d = tmp_path / "d"
    d.mkdir()
    for i in range(4):
        with h5py.File(d / f"s{i}.h5", "w") as f:
            f["x"] = np.full((7 if i == 2 else 8, 4, 4), i, np.float32)
            f.attrs["datastore_layout"] = "per-sample"
    with pytest.raises(DatasetError) as got:
        open_dataset(str(d))
    assert str(got.value) == (
        f"{d}/s2.h5: holds x <f4 (7, 4, 4), unlike the set's first file {d}/s0.h5: x <f4 (8, 4, "
        "4); the files say they hold one sample each (datastore_layout='per-sample'), and files "
        "of one sample each hold identical shapes"
    )


# -- staged with --mode shard: whole files per node ----------------------------------------------
def test_owners_of_shard_files_split_each_nodes_samples():
    # a: 3 samples, b: 2, c: 4; ranks 0-1 hold a and c, rank 2 holds b
    names, counts = ["a", "b", "c"], [3, 2, 4]
    holders = [["a", "c"], ["a", "c"], ["b"]]
    assert owners_by_holders(names, holders, counts)[np.arange(9)].tolist() == [
        0,
        0,
        0,
        2,
        2,
        0,
        1,
        1,
        1,
    ]
    assert owners_by_holders(names, holders)[np.arange(3)].tolist() == [
        0,
        2,
        1,
    ]  # one sample per file


def test_plan_shards_refuses_nodes_that_disagree():
    sig = {"x": ("float32", (2,))}
    ok = [("hdf5", {"a": 3, "c": 4}, sig), ("hdf5", {"b": 2}, sig)]
    names, counts, owner = plan_shards(ok)
    assert (names, counts.tolist()) == (["a", "b", "c"], [3, 2, 4])
    assert owner[np.arange(9)].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0]
    assert plan_shards([ok[0], ok[0]]) is None  # every rank holds the same files
    assert plan_shards([ok[0], (None, {}, sig)]) is None  # not shardable somewhere
    mixed = [("hdf5", {"a": 3, "c": 4}, sig), ("hdf5-per-sample", {"b": 1, "d": 1}, sig)]
    with pytest.raises(ValueError, match=r"ranks 0: hdf5; ranks 1: hdf5-per-sample.*format"):
        plan_shards(mixed)
    with pytest.raises(ValueError, match=r"'a' holds 3 samples on rank 0 and 2 on rank 1"):
        plan_shards([ok[0], ("hdf5", {"a": 2}, sig)])
    with pytest.raises(ValueError, match="different fields or shapes"):
        plan_shards([ok[0], ("hdf5", {"b": 2}, {"x": ("float32", (3,))})])


def test_a_local_view_maps_the_global_index_to_local_shards(shards):
    d, a = shards  # this "node" holds part-000 (4) and part-002 (3) of a 4 + 5 + 3 set
    os.unlink(d / "part-001.h5")
    names = ["part-000.h5", "part-001.h5", "part-002.h5"]
    with open_dataset(str(d)) as local:
        view = LocalView.of_names(local, names, ["part-000.h5", "part-002.h5"], COUNTS)
        assert len(view) == 12
        for i in [*range(4), *range(9, 12)]:
            assert view.read(i, "x").tobytes() == a["x"][i].tobytes()
        with pytest.raises(ValueError, match=r"sample 4 is not on this node"):
            view.read(4, "x")
        assert local_files(local, str(d)) == {"part-000.h5": 4, "part-002.h5": 3}
    with open_dataset(str(d / "part-000.h5")) as one:  # a file named is the dataset itself
        assert local_files(one, str(d)) is None


@pytest.mark.mpi
def test_the_loader_reads_each_nodes_staged_shard_files(tmp_path):
    """6 shard files of distinct sizes staged by ``--mode shard`` over 2 nodes: each rank stores
    exactly its node's samples, and the batches are those of one directory."""
    counts = (2, 3, 4, 5, 6, 8)  # distinct: any node's share is detected as shards
    src, env = stage_sharded(tmp_path, write=lambda s: write_set(s, counts))
    out = tmp_path / "out.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", JOB]
    proc = subprocess.run(
        [*cmd, str(tmp_path), str(src), str(out), "4"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["steps"] == Schedule(sum(counts), 4, seed=5).order(0).reshape(-1, 4).tolist()
    starts = np.cumsum((0, *counts))
    for k in range(2):
        held = sorted(os.listdir(tmp_path / f"node{k}" / "src"))
        mine = [i for n in held for i in range(starts[int(n[5:8])], starts[int(n[5:8]) + 1])]
        assert sorted(result["stored"][k]) == mine


def test_one_sample_file_of_other_lengths_points_to_layout_per_sample(tmp_path):
    """CosmoFlow's one file per sample, a set of one: ``full`` (16, 16, 16, 4) and
    ``unitPar`` (4,) were refused saying only to name the fields, and ``fields=["full"]`` then
    read 16 samples of (16, 16, 4)."""
    (tmp_path / "d").mkdir()
    full = np.arange(16**3 * 4, dtype=np.float32).reshape(16, 16, 16, 4)
    with h5py.File(tmp_path / "d" / "univ_0.h5", "w") as f:
        f["full"], f["unitPar"] = full, np.arange(4, dtype=np.float32)
    with pytest.raises(DatasetError, match=r'one sample, say so \(layout="per-sample"\)'):
        open_dataset(str(tmp_path / "d"))
    with open_dataset(str(tmp_path / "d"), layout="per-sample") as r:
        assert (len(r), r.fields["full"].shape) == (1, (16, 16, 16, 4))
        assert r.read(0, "full").tobytes() == full.tobytes()

"""DataStoreLoader: order, contents, blocks, resume, memory budget; real mpiexec ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from helpers import MPIEXEC

from datastore import DataStoreLoader
from datastore.maths.order import Schedule
from datastore.maths.partition import Grid, extract_block
from datastore.sources.options import StoreOptions

N, C, D = 24, 2, 8
JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "loader_job.py")


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    """``x``: (N, C, D, D, D) float32 volumes; ``y``: (N, 4) labels; ``idx``: the sample index."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "train.h5"
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((N, C, D, D, D), dtype=np.float32)
        f["y"] = rng.standard_normal((N, 4), dtype=np.float32)
        f["idx"] = np.arange(N, dtype=np.int64)
    with h5py.File(path, "r") as f:
        return path, f["x"][...], f["y"][...]


def sequence(loader, epochs=1):
    return [b["idx"].tolist() for _ in range(epochs) for b in loader]


def test_batches_follow_the_schedule_and_hold_the_right_data(h5):
    path, x, y = h5
    loader = DataStoreLoader(str(path), batch_size=5, seed=3)
    assert len(loader) == N // 5
    order = Schedule(N, 5, seed=3).order(0)
    for step, batch in enumerate(loader):
        ids = order[step * 5 : (step + 1) * 5]
        assert batch["idx"].tolist() == ids.tolist()
        assert batch["x"].dtype == torch.float32 and batch["x"].shape == (5, C, D, D, D)
        assert np.array_equal(batch["x"].numpy(), x[ids])
        assert np.array_equal(batch["y"].numpy(), y[ids])
    assert loader.epoch == 1  # a finished epoch advances
    assert sequence(loader) == Schedule(N, 5, seed=3).order(1)[:20].reshape(4, 5).tolist()


def test_second_epoch_comes_from_memory(h5):
    loader = DataStoreLoader(str(h5[0]), batch_size=4, fields=["x", "idx"])
    c = loader.counters  # the preload read every sample: neither hits nor misses
    assert (c.hits, c.misses, c.bytes_read) == (0, 0, N * (C * D**3 * 4 + 8))
    sequence(loader, epochs=2)
    assert loader.counters.misses == 0 and loader.counters.hits == 2 * 2 * N


def test_counters_are_the_stores_counts_plus_the_loaders_own_wait(h5):
    """``loader.counters`` adds the consumer's wait to the store's counts; the store's own
    counters hold only what the store did."""
    with DataStoreLoader(str(h5[0]), batch_size=4, fields=["idx"]) as loader:
        sequence(loader)
        c, s = loader.counters, loader.store.counters
        assert (c.hits, c.misses, c.bytes_read) == (s.hits, s.misses, s.bytes_read) == (N, 0, N * 8)
        assert c.wait_seconds > 0 and c.bytes_exchanged == 0
        assert not hasattr(s, "wait_seconds")


def test_resume_mid_epoch_equals_uninterrupted(h5):
    path = str(h5[0])
    full = sequence(DataStoreLoader(path, batch_size=3, seed=9), epochs=2)
    first = DataStoreLoader(path, batch_size=3, seed=9)
    seen = []
    for i, b in enumerate(first):
        seen.append(b["idx"].tolist())
        if i == 4:
            break
    saved = first.state_dict()
    assert (saved["epoch"], saved["step"]) == (0, 5)
    second = DataStoreLoader(path, batch_size=3, seed=9)
    second.load_state_dict(saved)
    seen += sequence(second, epochs=2)[: len(full) - len(seen)]
    assert seen == full


def test_a_checkpoint_at_an_epochs_last_batch_resumes_with_set_epoch_of_that_epoch(h5):
    """The torch loop ``for e in range(saved_epoch, E): set_epoch(e); for b in loader`` that
    checkpoints every ``len(loader)`` steps saves ``{"epoch": e}`` at epoch ``e``'s last batch:
    resumed, epoch ``e`` has nothing left (as with ``StatefulDataLoader``); it was replayed."""
    path = str(h5[0])

    def run(saved=None):
        loader, seen, ckpt = DataStoreLoader(path, batch_size=6, seed=9), [], None
        if saved is not None:
            loader.load_state_dict(saved["data"])
        for e in range(saved["epoch"] if saved else 0, 3):
            loader.set_epoch(e)
            for b in loader:
                seen.append(b["idx"].tolist())
                if ckpt is None and len(seen) == len(loader):
                    ckpt = {"epoch": e, "data": loader.state_dict()}
        return seen, ckpt

    full, ckpt = run()
    assert (ckpt["epoch"], ckpt["data"]["epoch"], ckpt["data"]["step"]) == (0, 1, 0)
    assert run(ckpt)[0] == full[4:]


def test_resume_refuses_other_data_of_the_same_size_and_takes_a_copy(h5, tmp_path):
    """A state over one file resumes on a copy that keeps names, sizes and times, and is
    refused, naming both, on a file of the same shapes and size holding other samples."""
    path = str(h5[0])
    saved = DataStoreLoader(path, batch_size=3, seed=9).state_dict()
    other, copy = tmp_path / "other", tmp_path / "copy"
    other.mkdir(), copy.mkdir()
    shutil.copy2(path, copy / "train.h5")
    shutil.copy(path, other / "train.h5")
    with h5py.File(other / "train.h5", "r+") as f:
        f["idx"][...] = f["idx"][...][::-1]  # the same size, other bytes
    assert os.path.getsize(other / "train.h5") == os.path.getsize(path)
    DataStoreLoader(str(copy / "train.h5"), batch_size=3, seed=9).load_state_dict(saved)
    loader = DataStoreLoader(str(other / "train.h5"), batch_size=3, seed=9)
    with pytest.raises(ValueError, match="cannot resume: the state_dict was saved over") as e:
        loader.load_state_dict(saved)
    assert f"{path!r} (files {saved['dataset']['identity']})" in str(e.value)
    theirs = loader.state_dict()["dataset"]["identity"]
    assert f"{str(other / 'train.h5')!r} (files {theirs})" in str(e.value)
    loader.load_state_dict({**saved, "dataset": None})  # on other data on purpose


def test_a_state_loaded_while_a_pass_is_live_is_where_the_next_pass_starts(h5):
    """The live pass goes on (as ``StatefulDataLoader``'s old iterator) but no longer moves
    the position: its next batch overwrote the loaded one, and the next ``iter()`` went on
    from the old pass (epoch 0 step 2 instead of the loaded epoch 3 step 2)."""
    path = str(h5[0])
    loader = DataStoreLoader(path, batch_size=3, seed=1)
    saved = {**loader.state_dict(), "epoch": 3, "step": 2}
    live = iter(loader)
    old = [next(live)["idx"].tolist()]
    loader.load_state_dict(saved)
    old.append(next(live)["idx"].tolist())
    assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (3, 2)
    fresh = DataStoreLoader(path, batch_size=3, seed=1)
    fresh.load_state_dict(saved)
    assert sequence(loader) == sequence(fresh)
    assert old == sequence(DataStoreLoader(path, batch_size=3, seed=1))[:2]


def test_set_epoch_while_a_pass_is_live_is_where_the_next_pass_starts(h5):
    """As a ``DistributedSampler``'s ``set_epoch`` mid-pass: the live pass ends its epoch,
    the next pass is the epoch set (it was the live pass's next: epoch 1, not 5)."""
    path = str(h5[0])
    loader = DataStoreLoader(path, batch_size=3, seed=1)
    live = iter(loader)
    old = [next(live)["idx"].tolist()]
    loader.sampler.set_epoch(5)
    old += [b["idx"].tolist() for b in live]
    assert old == sequence(DataStoreLoader(path, batch_size=3, seed=1))
    assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (5, 0)
    order = Schedule(N, 3, 1, "global", "drop").order(5).tolist()
    assert [i for b in sequence(loader) for i in b] == order


def test_set_epoch_and_pad_tail(h5):
    loader = DataStoreLoader(str(h5[0]), batch_size=7, drop_last=False, seed=1)
    assert len(loader) == 4
    loader.set_epoch(5)
    seq = sequence(loader)
    assert [i for b in seq for i in b] == Schedule(N, 7, 1, True, "pad").order(5).tolist()
    with pytest.raises(ValueError, match="cannot resume: saved seed=1"):
        DataStoreLoader(str(h5[0]), batch_size=7, drop_last=False, seed=2).load_state_dict(
            loader.state_dict()
        )
    for other in ({"foo": 1}, {"epoch": 0, "step": 1}, [0, 1]):  # (a model's, say)
        with pytest.raises(ValueError, match="cannot resume: not a loader's state_dict") as e:
            loader.load_state_dict(other)
        assert "a loader's has version, epoch, step, num_samples" in str(e.value)


@pytest.mark.parametrize(
    ("parts", "halo"), [((2, 1, 1), (1, 1, 1)), ((2, 2, 1), (2, 1, 0)), ((1, 2, 2), (1, 1, 1))]
)
def test_each_spatial_rank_gets_its_block_with_halo(h5, parts, halo):
    path, x, _ = h5
    grid = Grid((D, D, D), parts, halo, "zero")
    for rank in range(grid.nblocks):
        with pytest.warns(UserWarning, match=f"{grid.nblocks} ranks .given. but no MPI"):
            loader = DataStoreLoader(
                str(path),
                batch_size=4,
                rank=rank,
                world=grid.nblocks,
                spatial={"parts": parts, "halo": halo},
                fields=["x", "idx"],
            )
        for batch in loader:
            for j, i in enumerate(batch["idx"].tolist()):
                assert np.array_equal(
                    batch["x"][j].numpy(), extract_block(x[i], grid, rank, (1, 2, 3))
                )


def test_memory_budget_spills_or_rereads_with_the_same_batches(h5, tmp_path):
    path = str(h5[0])
    want = sequence(DataStoreLoader(path, batch_size=4), epochs=2)
    per_sample = C * D**3 * 4 + 4 * 4 + 8
    for spill in (str(tmp_path / "spill"), None):
        loader = DataStoreLoader(
            path, batch_size=4, store=StoreOptions(memory_budget=5 * per_sample, spill_dir=spill)
        )
        assert loader.store.ram_slots == 5
        assert sequence(loader, epochs=2) == want
    assert os.listdir(tmp_path / "spill") == []  # the spill file is unlinked at once


def test_a_memory_budget_of_0_holds_no_sample(h5, tmp_path):
    """0 is a budget like any other: no RAM slot, so every sample spills to ``spill_dir``
    (read once) or, without one, is read from the dataset at every use."""
    path = str(h5[0])
    whole = DataStoreLoader(path, batch_size=4)
    once = whole.counters.bytes_read  # the preload's
    want = [b["x"].clone() for _ in range(2) for b in whole]
    reads = 2 * N * 3  # 2 epochs of each sample's 3 fields
    for spill, counts in (
        (str(tmp_path / "spill"), (reads, 0, once)),
        (None, (0, reads, 2 * once)),
    ):
        loader = DataStoreLoader(
            path, batch_size=4, store=StoreOptions(memory_budget=0, spill_dir=spill)
        )
        got = [b["x"] for _ in range(2) for b in loader]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        c = loader.counters
        assert (loader.store.ram_slots, c.bytes_resident) == (0, 0)
        assert (c.hits, c.misses, c.bytes_read) == counts


def test_bad_arguments_are_named(h5):
    path = str(h5[0])
    with pytest.raises(ValueError) as exc:  # (the reader, which reads only the fields named)
        DataStoreLoader(path, batch_size=4, fields=["z"])
    assert str(exc.value) == f"{path}: field 'z': not in the data (it has: idx, x, y)"
    with pytest.raises(ValueError, match="exactly one of batch_size"):
        DataStoreLoader(path)
    with (
        pytest.raises(ValueError, match="not a multiple of 2 spatial blocks"),
        pytest.warns(UserWarning, match="3 ranks .given. but no MPI"),
    ):
        DataStoreLoader(path, batch_size=2, rank=0, world=3, spatial={"parts": (2, 1, 1)})


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_global_order_is_the_same_at_1_2_4_ranks(h5, tmp_path, ranks):
    out = tmp_path / f"seq{ranks}.json"
    cmd = [
        MPIEXEC,
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "mpi4py",
        JOB,
        str(h5[0]),
        str(out),
        "8",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    sched = Schedule(N, 8, seed=11)
    want = [sched.order(e)[s * 8 : (s + 1) * 8].tolist() for e in range(2) for s in range(3)]
    assert steps == want
    if ranks > 1:
        assert json.loads(out.read_text())["bytes_exchanged"] > 0


@pytest.mark.mpi
def test_spatial_blocks_over_mpi_exchange(h5, tmp_path):
    out = tmp_path / "spatial.json"
    cmd = [
        MPIEXEC,
        "-n",
        "4",
        sys.executable,
        "-m",
        "mpi4py",
        JOB,
        str(h5[0]),
        str(out),
        "8",
        "1",
        "2,1,1",
        "1,1,1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sched = Schedule(N, 8, seed=11)
    want = [sched.order(0)[s * 8 : (s + 1) * 8].tolist() for s in range(3)]
    assert json.loads(out.read_text())["steps"] == want


@pytest.mark.mpi
@pytest.mark.parametrize("parts", ["2,1,1", "1,1,2"])
def test_blocks_over_mpi_exchange_in_runs_or_packed(tmp_path, parts):
    """Parts of 68 KiB runs sent in place (2,1,1) or of 68-byte runs packed (1,1,2), received
    aside amid the halo and copied in, buffers reused over 2 epochs: every block exact (the
    job checks each against the file)."""
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(1).standard_normal((12, 2, 32, 32, 32), dtype=np.float32)
        f["idx"] = np.arange(12, dtype=np.int64)
    out = tmp_path / "blocks.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", JOB, str(path), str(out), "4"]
    proc = subprocess.run([*cmd, "2", parts, "1,1,1"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sched = Schedule(12, 4, seed=11)
    want = [sched.order(e)[s * 4 : (s + 1) * 4].tolist() for e in range(2) for s in range(3)]
    got = json.loads(out.read_text())
    assert got["steps"] == want and got["bytes_exchanged"] > 0


@pytest.mark.timeout(60)  # the hang guard
def test_breaking_out_early_never_hangs(h5):
    """The consumer stops with the producer's queue full (prefetch 1, tiny batches)."""
    import time

    loader = DataStoreLoader(str(h5[0]), batch_size=1, prefetch=1, fields=["idx"])
    for _ in range(20):
        for i, _batch in enumerate(loader):
            if i == 0:
                time.sleep(0.05)  # let the producer fill the queue and finish the epoch
                break

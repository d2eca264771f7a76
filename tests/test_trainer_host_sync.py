"""A training step never waits for the device: its loss stays a device tensor and the log reads
the losses every ``log_every`` steps, all at once, with the values of every step unchanged.

On the CPU a read of a tensor into Python (``item``, ``tolist``, ``float()``, ...) stands for a
host sync; the steps are watched by a ``TorchFunctionMode`` (before: one read per step, the
loss, and two more on a grid, ``gather_flatten``'s shapes). On a GPU,
``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronizing CUDA call in a step."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import mpi_job, run_job

from trainer.config import ConfigError, TrainConfig
from trainer.cosmology import write_split
from trainer.start import start
from trainer.train import Trainer, fit, timed_batches

JOBS = Path(__file__).parent / "trainer_jobs"

sys.path.insert(0, str(JOBS))
from host_sync_job import ScalarReads  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """40 training and 8 validation samples of 8^3: 5 steps an epoch at batch 8."""
    out = tmp_path_factory.mktemp("cosmo8")
    write_split(out, 40, 8, 8, seed=0)
    return str(out)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory) -> str:
    """16 training samples of 16^3 with a noisy input field, for both models."""
    out = tmp_path_factory.mktemp("cosmo16")
    write_split(out, 16, 4, 16, seed=0, noise=0.3)
    return str(out)


def test_a_step_reads_nothing_from_its_tensors(tiny):
    cfg = TrainConfig(data=tiny, width=2, global_batch=8, steps=3, optimizer="sgd")
    t = Trainer(cfg, start(cfg))
    batches = timed_batches(t.loader)
    try:
        for _ in range(3):
            batch, _ = next(batches)
            with ScalarReads() as reads:
                loss, _ = t.train_step(batch, 0)
            assert reads.calls == [] and isinstance(loss, torch.Tensor)
    finally:
        batches.close()
        t.close()


@pytest.mark.mpi
def test_grid_steps_read_nothing_from_their_tensors(noisy, tmp_path):
    """2 ranks, a 2-way split over gloo: halo exchanges, ``gather_flatten`` (CosmoFlow),
    ``DistBatchNorm3d`` (U-Net), the gradient reducer and the loss summed over the world."""
    out = tmp_path / "out.json"
    cmd = mpi_job(2, JOBS / "host_sync_job.py", out, noisy, "cpu", "sgd", "2,1,1")
    results = run_job(cmd, out)
    for model, r in results.items():
        assert r["error"] is None and r["reads"] == [], (model, r)
        assert len(r["losses"]) == 4 and all(map(math.isfinite, r["losses"])), (model, r)


def test_logged_losses_are_every_steps_loss_in_order(tiny, tmp_path, capsys):
    """7 steps, the losses read every 3 steps, a checkpoint at step 4 and validation after the
    first epoch (5 steps): the same records, in the same order, with the losses a step reads
    at once (``float`` of the step's loss, as before)."""
    base = dict(data=tiny, width=2, global_batch=8, steps=7, seed=3, optimizer="sgd")
    cfg = TrainConfig(**base)
    t = Trainer(cfg, start(cfg))
    want = []
    batches = timed_batches(t.loader)
    try:
        while len(want) < 7:
            epoch = t.loader.epoch
            batch, _ = next(batches)
            if batch is not None:
                want.append(float(t.train_step(batch, epoch)[0]))
    finally:
        batches.close()
        t.close()
    log = tmp_path / "log.jsonl"
    sets = dict(log_every=3, print_every=2, log_file=str(log), checkpoint_interval=4)
    cfg = TrainConfig(**base, **sets, checkpoint_dir=str(tmp_path / "ck"))
    result = fit(Trainer(cfg, start(cfg)))
    assert result["losses"] == want
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r.get("event", r.get("step")) for r in records] == [
        "start", 1, 2, 3, 4, "checkpoint", 5, "validation", 6, 7, "validation", "checkpoint"
    ]  # fmt: skip
    steps = [r for r in records if "event" not in r]
    assert [r["loss"] for r in steps] == want
    assert all(r["samples_per_s"] > 0 and 0 <= r["data_wait"] <= 1 for r in steps)
    out = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["step"] for line in out if '"loss"' in line] == [2, 4, 6]


def test_log_every_must_be_positive():
    with pytest.raises(ConfigError, match="config key 'log_every': must be >= 1, got 0"):
        TrainConfig(data="d", log_every=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_training_steps_never_sync(noisy, tmp_path):
    """One process on NCCL (a 1x1x1 grid: DistConv3d, the pools, gather_flatten, DistBatchNorm3d,
    the reducer, the world-summed loss), bf16 autocast, channels_last_3d, cuDNN benchmark, Adam:
    two steps under ``set_sync_debug_mode("error")`` after two warm-up steps."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(JOBS / "host_sync_job.py"), str(out), noisy, "cuda:0", "adam"]
    results = run_job([*cmd, "1,1,1"], out)
    for model, r in results.items():
        assert r["error"] is None, f"{model}: a synchronizing CUDA call in a step:\n{r['error']}"
        assert len(r["losses"]) == 4 and all(map(math.isfinite, r["losses"])), (model, r)

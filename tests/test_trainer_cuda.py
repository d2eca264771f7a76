"""The trainer on a GPU: one rank on NCCL (bf16 autocast, channels_last_3d, batches delivered
on the device), ranks sharing one GPU over gloo (messages staged through pinned host memory)
following the one-rank run (and, in channels_last_3d, the contiguous one), and Lion Cub's exact
resume there. Skipped without CUDA. The tests of several ranks are marked ``mpi`` too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MPIEXEC, job_env, set_args

from trainer.cosmology import write_split

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ENV = job_env()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cosmo")
    write_split(out, 32, 8, 16, 0, noise=0.3)
    return out


def launch(n: int, sets: list[str]) -> subprocess.CompletedProcess:
    argv = ["-m", "trainer", "train", *set_args(sets)]
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)


def log_of(path: Path) -> tuple[list[float], list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if r.get("event")]


def base(data: Path, log: Path, *more: str) -> list[str]:
    return [
        f"data={data}", "width=4", "conv_blocks=3", "global_batch=8", "steps=8", "lr=1e-3",
        f"log_file={log}", *more,
    ]  # fmt: skip


@pytest.mark.parametrize("model", ["cosmoflow", "unet3d"])
def test_one_rank_trains_on_the_gpu_over_nccl(data, tmp_path, model):
    fields = ["input_field=noisy", "target_field=x"] if model == "unet3d" else []
    proc = launch(1, base(data, tmp_path / "log", f"model={model}", *fields))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses, events = log_of(tmp_path / "log")
    start = events[0]
    assert start["device"] == "cuda:0" and start["backend"] == "nccl", start
    assert len(losses) == 8 and all(map(torch.isfinite, torch.tensor(losses)))
    val = [e for e in events if e["event"] == "validation"][-1]
    assert val["val_mse"] > 0


@pytest.mark.mpi  # several ranks (gpu_session.sh runs these first)
def test_ranks_sharing_the_gpu_follow_one_rank(data, tmp_path):
    """float32 (amp and TF32 off) so that the split and the whole model compute alike."""
    more = ["amp=false", "tf32=false", "backend=gloo"]
    one = launch(1, base(data, tmp_path / "one", *more))
    assert one.returncode == 0, one.stdout + one.stderr
    two = launch(4, base(data, tmp_path / "four", *more, "spatial_parts=[2,1,1]"))
    assert two.returncode == 0, two.stdout + two.stderr
    (a, _), (b, events) = log_of(tmp_path / "one"), log_of(tmp_path / "four")
    assert events[0]["backend"] == "gloo" and events[0]["device"] == "cuda:0"
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-3


@pytest.mark.mpi  # several ranks (gpu_session.sh runs these first)
def test_channels_last_ranks_sharing_the_gpu_follow_one_contiguous_rank(data, tmp_path):
    """channels_last_3d end to end in training (input blocks, weights, halos, gradients) on 2
    ranks splitting every sample on the one GPU over gloo, against one rank in contiguous
    format; float32 (amp and TF32 off)."""
    more = ["amp=false", "tf32=false", "backend=gloo", "cudnn_benchmark=false"]
    one = launch(1, base(data, tmp_path / "one", *more, "channels_last=false"))
    assert one.returncode == 0, one.stdout + one.stderr
    two = launch(2, base(data, tmp_path / "two", *more, "spatial_parts=[2,1,1]"))
    assert two.returncode == 0, two.stdout + two.stderr
    (a, _), (b, events) = log_of(tmp_path / "one"), log_of(tmp_path / "two")
    start = events[0]
    assert (start["device"], start["backend"], start["world"]) == ("cuda:0", "gloo", 2), start
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert diff < 1e-3, f"losses off by {diff}: contiguous {a}, channels_last split {b}"


def resumed_and_whole(n: int, data: Path, tmp: Path, more: list[str]) -> tuple[list, list]:
    """The losses of a run stopped after 4 steps and resumed, and of the same run whole."""
    whole = launch(n, base(data, tmp / "w", *more, f"checkpoint_dir={tmp}/w.ck"))  # w: its log
    assert whole.returncode == 0, whole.stdout + whole.stderr
    ck = f"checkpoint_dir={tmp}/r"
    first = launch(n, base(data, tmp / "a", *more, ck, "steps=4"))
    rest = launch(n, base(data, tmp / "b", *more, ck))
    assert first.returncode == 0 and rest.returncode == 0, rest.stdout + rest.stderr
    (w, _), (a, _), (b, _) = (log_of(tmp / k) for k in "wab")
    return a + b, w


@pytest.mark.mpi  # several ranks (gpu_session.sh runs these first)
def test_lion_cub_resume_on_the_gpu_is_exact(data, tmp_path):
    more = ["optimizer=lion_cub", "backend=gloo", "amp=false", "tf32=false"]
    resumed, whole = resumed_and_whole(2, data, tmp_path, [*more, "cudnn_benchmark=false"])
    assert len(resumed) == len(whole)
    assert max(abs(x - y) for x, y in zip(resumed, whole, strict=True)) < 1e-4  # cuDNN may vary


def test_resume_with_dropout_on_the_gpu_repeats_the_run(data, tmp_path):
    """Dropout on the GPU draws from the device's generator: the checkpoint carries its state,
    so the resumed steps drop the same units as the uninterrupted run."""
    more = ["dropout=0.5", "amp=false", "tf32=false", "cudnn_benchmark=false"]
    resumed, whole = resumed_and_whole(1, data, tmp_path, more)
    assert len(resumed) == len(whole)
    assert max(abs(x - y) for x, y in zip(resumed, whole, strict=True)) < 1e-4  # cuDNN may vary

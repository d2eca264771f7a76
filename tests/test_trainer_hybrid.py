"""The hybrid-parallel driver under real ``mpiexec``: a 2 x 2 (data x spatial) run follows the
one-process run's losses, gets the same batches from ``datastore serve`` as from the embedded
loader, a resumed 2 x 2 run equals an uninterrupted one, and a rank that raises ends the whole
job quickly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import MPIEXEC, serving, set_args

from staging.cluster import LAUNCH_ENV
from trainer.cosmology import write_split

pytestmark = pytest.mark.mpi

JOBS = Path(__file__).parent / "trainer_jobs"
ROOT = Path(__file__).parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
STEPS = 6  # 40 samples / 8 per step: an epoch ends at step 5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cosmo")
    write_split(out, 40, 8, 16, 0)
    return out


def args(data: Path, tmp: Path, name: str, *more: str) -> list[str]:
    sets = [
        f"data={data}", "width=2", "conv_blocks=3", "global_batch=8", f"steps={STEPS}",
        "optimizer=sgd", "lr=0.05", "warmup=2", f"log_file={tmp / name}.log", *more,
    ]  # fmt: skip
    return set_args(sets)


def launch(n: int, argv: list[str], script: list[str] | None = None, timeout: float = 120):
    script = script or ["-m", "trainer", "train"]
    if n == 1:
        cmd = [sys.executable, *script, *argv]
    else:
        cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", *script, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def records(path: Path) -> tuple[list[float], list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if r.get("event")]


@pytest.fixture(scope="module")
def grid_run(data, tmp_path_factory) -> Path:
    """The uninterrupted 2 x 2 run, with its final checkpoint."""
    tmp = tmp_path_factory.mktemp("grid")
    proc = launch(4, args(data, tmp, "run", "spatial_parts=[2,1,1]", f"checkpoint_dir={tmp}/ck"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("trained 6 steps") == 1  # rank 0 only
    return tmp


def test_grid_losses_follow_one_process(data, grid_run, tmp_path):
    proc = launch(1, args(data, tmp_path, "one"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    one, one_events = records(tmp_path / "one.log")
    grid, grid_events = records(grid_run / "run.log")
    assert len(one) == len(grid) == STEPS
    assert max(abs(a - b) for a, b in zip(one, grid, strict=True)) < 1e-4
    one_val = [e["val_mse"] for e in one_events if e["event"] == "validation"]
    grid_val = [e["val_mse"] for e in grid_events if e["event"] == "validation"]
    assert len(one_val) == len(grid_val) == 2
    assert max(abs(a - b) for a, b in zip(one_val, grid_val, strict=True)) < 1e-4


def test_one_process_fed_by_a_tcp_service_with_its_token(data, grid_run, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    token.chmod(0o600)
    with socket.socket() as s:  # a free port for the TCP listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serving(tmp_path, ENV, "--tcp", f"127.0.0.1:{port}", "--token-file", str(token)):
        where = f"data_address=127.0.0.1:{port}"
        proc = launch(1, args(data, tmp_path, "t", where, f"data_token_file={token}"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        refused = launch(1, args(data, tmp_path, "n", where))  # no token: refused, named
        missing = launch(1, args(data, tmp_path, "m", where, f"data_token_file={tmp_path}/x"))
    one, _ = records(tmp_path / "t.log")
    grid, _ = records(grid_run / "run.log")
    assert max(abs(a - b) for a, b in zip(one, grid, strict=True)) < 1e-4
    assert refused.returncode == 2 and "data_address" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert missing.returncode == 2 and f"'data_token_file': {tmp_path}/x" in missing.stderr


def test_grid_fed_by_the_service_and_resumed_equals_uninterrupted(data, grid_run, tmp_path):
    """A 2 x 2 run fed by ``datastore serve`` gets the embedded loader's batches (the same
    losses), and one stopped after 4 steps and resumed from its checkpoint equals the
    uninterrupted run: losses, validations (the baseline's sums too), weights, loader state."""
    ck = f"checkpoint_dir={tmp_path}/ck"
    with serving(tmp_path, ENV) as sock:
        fed = ["spatial_parts=[2,1,1]", f"data_address={sock}", ck]
        first = launch(4, args(data, tmp_path, "a", *fed, "steps=4"))
        assert first.returncode == 0, first.stdout + first.stderr
        rest = launch(4, args(data, tmp_path, "b", *fed))
        assert rest.returncode == 0, rest.stdout + rest.stderr
    a, _ = records(tmp_path / "a.log")
    b, b_events = records(tmp_path / "b.log")
    whole, whole_events = records(grid_run / "run.log")
    assert b_events[0]["data_source"] == "service"
    assert a == whole[:4]
    assert a + b == whole
    assert validations(b_events) == validations(whole_events)
    got = torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=True)
    want = torch.load(grid_run / "ck" / "checkpoint.pt", weights_only=True)
    assert got["step"] == want["step"] == STEPS
    assert got["loader"] == want["loader"]
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    # the first dense layer, split by columns over the 2 spatial ranks, is saved whole
    # (width 2, 3 blocks: 8 channels x 2^3 features), its momentum too
    assert want["model"]["head.0.weight"].shape == (128, 64)
    momenta = [s["momentum_buffer"].shape for s in want["optimizer"]["state"].values()]
    assert (128, 64) in momenta and (128, 32) not in momenta


def validations(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "validation"]


def test_unet_resume_on_two_data_ranks_validates_as_uninterrupted(noisy, tmp_path):
    """Each data rank sums its own samples' targets (the baseline) and keeps BatchNorm running
    statistics of its own samples (per-replica statistics): a run stopped in its first epoch
    and resumed validates exactly as the uninterrupted run (the checkpoint held rank 0's sums
    and statistics alone, and every rank resumed them: baseline 0.21024 for 0.21023)."""
    more = ["model=unet3d", "input_field=noisy", "target_field=x", "width=4", "steps=6",
            "global_batch=4", "lr=1e-3", "optimizer=adam"]  # fmt: skip
    whole = launch(2, args(noisy, tmp_path, "w", *more, f"checkpoint_dir={tmp_path}/w"))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    ck = f"checkpoint_dir={tmp_path}/r"
    first = launch(2, args(noisy, tmp_path, "a", *more, ck, "steps=1"))
    assert first.returncode == 0, first.stdout + first.stderr
    rest = launch(2, args(noisy, tmp_path, "b", *more, ck))
    assert rest.returncode == 0, rest.stdout + rest.stderr
    (w, we), (a, _), (b, be) = (records(tmp_path / f"{n}.log") for n in "wab")
    assert a + b == w
    assert [e["step"] for e in validations(be)] == [4, 6]
    assert validations(be) == validations(we)
    got = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    want = torch.load(tmp_path / "w" / "checkpoint.pt", weights_only=True)
    assert len(got["buffers"]) == 2 and len(got["targets"]) == 2
    saved = zip(got["buffers"] + got["targets"], want["buffers"] + want["targets"], strict=True)
    for mine, ref in saved:
        assert mine.keys() == ref.keys()
        for k, v in ref.items():
            assert torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(v)), k


def test_failing_rank_ends_the_job(data, tmp_path):
    t0 = time.monotonic()
    proc = launch(4, args(data, tmp_path, "f", "spatial_parts=[2,1,1]", "comm_timeout=10"),
                  script=[str(JOBS / "train_fail_job.py")], timeout=60)  # fmt: skip
    assert time.monotonic() - t0 < 60
    assert proc.returncode != 0
    assert "fails on purpose at step 2" in proc.stdout + proc.stderr
    steps, _ = records(tmp_path / "f.log")
    assert len(steps) == 2


def test_the_data_ranks_share_the_dataset_through_the_exchange(grid_run):
    _, events = records(grid_run / "run.log")
    start = events[0]
    assert start["event"] == "start" and start["world"] == 4
    assert start["spatial_parts"] == [2, 1, 1] and start["data_source"] == "mpi"


@pytest.fixture(scope="module")
def noisy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("noisy")
    write_split(out, 16, 4, 16, 0, noise=0.3)
    return out


def test_unet_split_in_two_follows_one_process(noisy, tmp_path):
    """The U-Net's every activation split over 2 ranks (BatchNorm over the sample's blocks):
    the same losses and validation as one process, the voxel loss being the sum of the
    blocks' shares."""
    more = ["model=unet3d", "input_field=noisy", "target_field=x", "width=4", "steps=4",
            "global_batch=4", "lr=1e-3"]  # fmt: skip
    one = launch(1, args(noisy, tmp_path, "one", *more))
    assert one.returncode == 0, one.stdout + one.stderr
    two = launch(2, args(noisy, tmp_path, "two", *more, "spatial_parts=[1,2,1]"))
    assert two.returncode == 0, two.stdout + two.stderr
    (a, ea), (b, eb) = records(tmp_path / "one.log"), records(tmp_path / "two.log")
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    va = [e for e in ea if e["event"] == "validation"]
    vb = [e for e in eb if e["event"] == "validation"]
    for key in ("val_mse", "baseline_mse", "identity_mse"):
        assert vb[-1][key] == pytest.approx(va[-1][key], rel=1e-5), key


def test_lion_cub_resume_is_exact_on_every_data_rank(data, tmp_path):
    """Each data rank keeps its own momenta and its own dropout stream (every rank's samples
    were masked alike: each drew from one seed, and the checkpoint kept rank 0's state): a
    resumed run reloads every rank's own, so it equals the uninterrupted run (losses and
    weights). The first part is killed while it saves step 4, between the data ranks' files and
    checkpoint.pt: it resumes from step 3 (the files used to be overwritten in place, and the
    run could not resume at all: step 3's checkpoint, step 4's momenta)."""
    more = ["optimizer=lion_cub", "lr=1e-3", "dropout=0.3"]
    whole = launch(2, args(data, tmp_path, "w", *more, f"checkpoint_dir={tmp_path}/w"))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    ck = f"checkpoint_dir={tmp_path}/r"
    part = args(data, tmp_path, "a", *more, ck, "steps=4", "checkpoint_interval=3")
    first = launch(2, ["4", *part], script=[str(JOBS / "save_crash_job.py")])
    assert first.returncode != 0, first.stdout + first.stderr
    assert sorted(os.listdir(tmp_path / "r")) == [
        "checkpoint.pt", "optimizer.d0.step3.pt", "optimizer.d0.step4.pt",
        "optimizer.d1.step3.pt", "optimizer.d1.step4.pt", "run.lock",
    ]  # fmt: skip
    # one data rank's momenta gone: refused before a step, on both ranks alike (was: rank 1
    # alone, after rank 0 had resumed)
    aside = tmp_path / "optimizer.d1.step3.pt"
    (tmp_path / "r" / aside.name).rename(aside)
    lost = launch(2, args(data, tmp_path, "x", *more, ck))
    assert lost.returncode == 2, lost.stdout + lost.stderr
    assert lost.stderr.count("optimizer.d1.step3.pt: missing or not from step 3") == 2, lost.stderr
    assert "resumed" not in lost.stdout and "Abort" not in lost.stderr
    aside.rename(tmp_path / "r" / aside.name)
    rest = launch(2, args(data, tmp_path, "b", *more, ck))
    assert rest.returncode == 0, rest.stdout + rest.stderr
    assert "resumed from step 3" in rest.stdout
    (w, _), (a, _), (b, _) = (records(tmp_path / f"{n}.log") for n in "wab")
    assert a[:3] + b == w
    assert sorted(os.listdir(tmp_path / "r")) == [  # step 4's stale files gone; the last two
        "checkpoint.pt", "optimizer.d0.step3.pt", "optimizer.d0.step6.pt",  # saves' kept
        "optimizer.d1.step3.pt", "optimizer.d1.step6.pt", "run.lock",
    ]  # fmt: skip
    got = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=True)
    want = torch.load(tmp_path / "w" / "checkpoint.pt", weights_only=True)
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert len(got["rng"]) == 2 and not torch.equal(*got["rng"])  # a stream per data rank
    for mine, ref in zip(got["rng"], want["rng"], strict=True):
        assert torch.equal(mine, ref)
    for d in (0, 1):
        mine = torch.load(tmp_path / "r" / f"optimizer.d{d}.step6.pt", weights_only=True)
        ref = torch.load(tmp_path / "w" / f"optimizer.d{d}.step6.pt", weights_only=True)
        for key, state in ref["optimizer"]["state"].items():
            assert torch.equal(mine["optimizer"]["state"][key]["exp_avg"], state["exp_avg"])

"""Halo exchange and DistConv3d under real ``mpiexec`` ranks on gloo, against single-process
references: the dot-product adjoint test, forward halos vs ``extract_block`` (whole, and split
into start and finish as the overlapped convolution uses it), conv outputs and every gradient
vs ``torch.nn.Conv3d`` with and without overlap; and a failing or stalled rank ends the job
quickly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import MPIEXEC

from staging.cluster import LAUNCH_ENV

pytestmark = pytest.mark.mpi

JOBS = Path(__file__).parent / "trainer_jobs"
ROOT = Path(__file__).parent.parent

sys.path.insert(0, str(JOBS))
import spatial_job  # noqa: E402  (the case list, to parametrize over)

# No launcher variables leak in from an outer job: each test picks its launcher itself.
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    OMP_NUM_THREADS="1",
)


def mpirun(n: int, job: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    assert MPIEXEC, "mpiexec not found next to the interpreter (pip install mpich)"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(JOBS / job), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


_results: dict[int, dict] = {}


def results(n: int, tmp_path_factory) -> dict:
    """Run the spatial job on ``n`` ranks once per module; ``{case: {check: worst error}}``.

    One rank runs as a plain process (init_distributed's single-process path), more under
    ``mpiexec``.
    """
    if n not in _results:
        out = tmp_path_factory.mktemp(f"spatial{n}") / "out.json"
        if n == 1:
            cmd = [sys.executable, str(JOBS / "spatial_job.py"), str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
        else:
            proc = mpirun(n, "spatial_job.py", str(out))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _results[n] = json.loads(out.read_text())
    return _results[n]


def cases(kind: str) -> list:
    out = []
    for n, rows in spatial_job.CASES.items():
        for parts, halos, kernels in rows:
            data = n // (parts[0] * parts[1] * parts[2])
            name = f"parts={tuple(parts)}, data={data}"
            marks = [pytest.mark.slow] if n > 4 else []
            if kind == "halo":
                keys = [f"halo {tuple(h)}, {name}" for h in halos]
            else:
                keys = [
                    f"conv k={k} overlap={o}, {name}" for k in kernels for o in spatial_job.OVERLAPS
                ]
            out += [pytest.param(n, key, id=f"{n}ranks-{key}", marks=marks) for key in keys]
    return out


@pytest.mark.parametrize(("n", "key"), cases("halo"))
def test_halo_adjoint_and_forward(n, key, tmp_path_factory):
    r = results(n, tmp_path_factory)[key]
    for split in ("", "split_"):  # halo_exchange; start_halo_exchange + finish_halo_exchange
        # <H x, y> == <x, H^T y> summed over the spatial group (float64, random x, y per rank).
        assert r[f"{split}adjoint_rel"] < 1e-12, r
        # The halo holds exactly the neighbours' voxels, corners included, zero outside.
        assert r[f"{split}forward_abs"] == 0.0, r


@pytest.mark.parametrize(("n", "key"), cases("conv"))
def test_dist_conv3d_matches_conv3d(n, key, tmp_path_factory):
    r = results(n, tmp_path_factory)[key]
    assert r["same_weights"] == 0.0, r  # broadcast from rank 0 despite different seeds
    assert r["overlapped"] == 0.0, r  # overlap=True overlaps wherever an axis exchanges
    assert r["wait_count"] == 0.0, r  # wait_clock: one wait per exchanging axis and pass
    for check in ("output_rel", "input_grad_rel", "weight_grad_rel", "bias_grad_rel"):
        assert r[check] < 1e-5, (check, r)  # float32; weight/bias summed over the spatial group
    assert r["data_sum_rel"] < 1e-5, r  # then summed over the data group: both samples' grads


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_failing_rank_ends_the_job(mode):
    start = time.monotonic()
    proc = mpirun(2, "fail_job.py", mode, timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert elapsed < 60
    assert "got a halo from a failed rank" not in proc.stdout
    want = "fails on purpose" if mode == "raise" else "Timed out"
    assert want in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_torchrun_launch_passes_the_same_checks(tmp_path, tmp_path_factory):
    """init_distributed's torchrun path (RANK, WORLD_SIZE, MASTER_ADDR/PORT from the env)."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(JOBS / "spatial_job.py"), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert got.keys() == results(2, tmp_path_factory).keys()
    for key, r in got.items():
        for check, err in r.items():
            assert err < (1e-12 if check.endswith("adjoint_rel") else 1e-5), (key, check, err)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [2, 4])
def test_halo_and_conv_on_cuda_pass_the_same_checks(n, tmp_path):
    """The halo exchange (both forms) and DistConv3d (overlap on and off) on GPU tensors, every
    rank on the one GPU over gloo (halos staged through pinned host memory): the same exact
    halos and adjoint, and the same outputs and gradients as ``torch.nn.Conv3d``."""
    out = tmp_path / "out.json"
    proc = mpirun(n, "spatial_job.py", str(out), "cuda:0", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert sorted(got) == sorted(
        key for m, key in (p.values for p in cases("halo") + cases("conv")) if m == n
    )
    for key, r in got.items():
        for check, err in r.items():
            if check.endswith("adjoint_rel"):
                assert err < 1e-12, (key, check, err)
            elif check.endswith("forward_abs") or check in (
                "same_weights",
                "overlapped",
                "wait_count",
            ):
                assert err == 0.0, (key, check, err)
            else:
                assert err < 1e-5, (key, check, err)

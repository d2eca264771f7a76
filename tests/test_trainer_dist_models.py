"""Models built with ``DistLayers`` under real ``mpiexec`` ranks equal the single-process models
on the whole batch: CosmoFlow's outputs and reduced gradients, a U-Net's output blocks and
gradients (BatchNorm over the world), over two SGD steps and one of the trainer's LARS (the
split weight's trust ratio from its whole norms), in float64; CosmoFlow's first dense layer
split by columns, its state gathered whole and loaded back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import mpi_job, run_job

pytestmark = pytest.mark.mpi

JOBS = Path(__file__).parent / "trainer_jobs"
TOL = 1e-5


def run_models(n: int, out: Path, device: str = "cpu") -> dict:
    return run_job(mpi_job(n, JOBS / "dist_model_job.py", out, device), out)


def check(results: dict) -> None:
    for case, checks in results.items():
        assert len(checks) == 20, case
        for name, err in checks.items():
            assert err < TOL, f"{case}: {name} off by {err}"


@pytest.mark.parametrize("n", [2, 4])
def test_dist_layers_equal_single_process(n, tmp_path):
    results = run_models(n, tmp_path / "out.json")
    want = {
        2: ["parts=(2, 1, 1), data=1"],
        4: ["parts=(2, 1, 1), data=2", "parts=(2, 2, 1), data=1"],
    }
    assert sorted(results) == want[n]
    check(results)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [2, 4, 8])
def test_dist_layers_on_cuda_equal_single_process(n, tmp_path):
    """The same on the GPU: every rank on GPU 0 over gloo (halos, BatchNorm sums, the gathered
    flatten and the gradient buckets staged through pinned host memory); splits along 1, 2 and
    3 axes and a 2 data x 2 spatial world."""
    results = run_models(n, tmp_path / "out.json", "cuda:0")
    want = {
        2: ["parts=(1, 1, 2), data=1", "parts=(2, 1, 1), data=1"],
        4: ["parts=(2, 1, 1), data=2", "parts=(2, 2, 1), data=1"],
        8: ["parts=(2, 2, 2), data=1"],
    }
    assert sorted(results) == want[n]
    check(results)


def test_only_the_writer_assembles_the_whole_state(tmp_path):
    """A checkpoint's whole first dense weight and momentum (2 uneven blocks) are assembled on
    spatial rank 0, which writes it, exactly as every rank assembled them before; the others
    send their columns and get ``None`` (before, each rank held the whole state: 287 MiB of
    peak RSS per rank in one save of a 2-way split, width 32)."""
    out = tmp_path / "rows.json"
    rows = run_job(mpi_job(2, JOBS / "whole_state_job.py", out), out)
    assert rows == [
        {"model": True, "optimizer": True},
        {"model": "none", "optimizer": "none"},
    ]

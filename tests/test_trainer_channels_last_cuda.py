"""``channels_last_3d`` end to end on one GPU shared by 2 ``mpiexec`` ranks over gloo (halos
staged through pinned host memory: NCCL refuses two ranks on one GPU), split along the outer
and along the inner axis (tests/trainer_jobs/channels_last_job.py): the halo exchange and
``DistConv3d`` on a ``channels_last_3d`` block and weight give the contiguous run's values, keep
the layout in outputs and input gradients, and no operation makes a tensor with its channels
not innermost. float32 with TF32 off. The same 2-rank job and checks run on the CPU too (the
``cpu`` variants; the CPU test of 4 ranks, float32 and float64, exactly, is
test_trainer_channels_last.py); a training step in ``channels_last_3d`` on ranks sharing the GPU
against one contiguous rank is in test_trainer_cuda.py. The ``cuda`` variants skip without
CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import mpi_job, run_job

pytestmark = pytest.mark.mpi
CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

JOBS = Path(__file__).parent / "trainer_jobs"
# cuDNN may pick other algorithms for the two layouts, which sum in other orders: each
# difference is held within 1e-4 of that quantity's largest value (a misplaced or missing halo
# voxel is off by about the value itself)
TOL = 1e-4


@pytest.fixture(
    scope="module", params=[pytest.param("cuda:0", id="cuda", marks=CUDA), pytest.param("cpu")]
)
def results(request, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("channels_last_2_ranks") / "out.json"
    cmd = mpi_job(2, JOBS / "channels_last_job.py", out, request.param)
    return run_job(cmd, out, timeout=180)


def cases(results: dict, prefix: str) -> dict:
    """The float32 cases (the only ones on a GPU; the CPU runs float64 too)."""
    got = {k: v for k, v in results.items() if k.startswith(prefix) and k.endswith("float32")}
    assert len(got) == {"halo": 8, "conv": 6}[prefix], f"the job ran other cases: {sorted(results)}"
    return got


def test_halo_exchange_of_2_ranks_keeps_channels_last_exactly(results):
    """Whole and split (start/finish), halos (1, 1, 1) and (2, 1, 0): copies and sums of the
    same values in the same order, so exactly the contiguous run's."""
    for key, r in cases(results, "halo").items():
        assert r["output"] == 0 and r["input_grad"] == 0, f"{key}: values differ by layout: {r}"
        assert r["output_not_cl"] == 0 and r["input_grad_not_cl"] == 0, f"{key}: layout lost {r}"
        assert r["conversions"] == [], f"{key}: channels not innermost: {r['conversions'][:4]}"


def test_dist_conv3d_of_2_ranks_keeps_channels_last(results):
    """Overlap on and off, stride 1 and 2; the weight in ``channels_last_3d`` as the trainer's
    ``model.to(memory_format=...)`` leaves it."""
    for key, r in cases(results, "conv").items():
        for what in ("output", "input_grad", "weight_grad", "bias_grad"):
            assert r[what] <= TOL * r[f"{what}_scale"], f"{key}: {what} differs by layout: {r}"
        assert r["output_not_cl"] == 0 and r["input_grad_not_cl"] == 0, f"{key}: layout lost {r}"
        assert r["conversions"] == [], f"{key}: channels not innermost: {r['conversions'][:4]}"
        assert r["overlapped"] == ("overlap=True" in key), key

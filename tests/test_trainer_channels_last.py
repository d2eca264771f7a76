"""A ``channels_last_3d`` block stays ``channels_last_3d`` through the halo exchange and
``DistConv3d``, forward and backward, under 4 real ``mpiexec`` ranks on gloo: the same values as
the contiguous block, outputs and input gradients in ``channels_last_3d``, and no operation
makes a tensor with its channels not innermost (before: the halo cloned into contiguous
buffers and blocks, and the convolution sliced and concatenated pieces of mixed layouts, 64 to
408 such tensors per case)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import mpi_job, run_job

pytestmark = pytest.mark.mpi

JOBS = Path(__file__).parent / "trainer_jobs"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("channels_last") / "out.json"
    return run_job(mpi_job(4, JOBS / "channels_last_job.py", out), out, timeout=180)


def cases(results: dict, prefix: str, dtype: str) -> dict:
    got = {k: v for k, v in results.items() if k.startswith(prefix) and k.endswith(dtype)}
    assert len(got) == {"halo": 8, "conv": 6}[prefix], sorted(results)
    return got


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_halo_exchange_keeps_channels_last_exactly(results, dtype):
    """Whole and split (start/finish), halos (1, 1, 1) and (2, 1, 0), two split axes."""
    for key, r in cases(results, "halo", dtype).items():
        assert r["output"] == 0 and r["input_grad"] == 0, (key, r)
        assert r["output_not_cl"] == 0 and r["input_grad_not_cl"] == 0, (key, r)
        assert r["conversions"] == [], key


def test_dist_conv3d_keeps_channels_last_in_float32(results):
    """Overlap on and off, stride 1 and 2. Weight and bias gradients are exact; the output
    and the input gradient are torch's own CPU convolution, forward and backward, which
    rounds differently by layout and by the kernels oneDNN picks for the CPU and its load (a
    plain ``F.conv3d`` differs as much): within 16 float32 ulps of their largest value (seen:
    outputs 0 to 4.8e-7, input gradients 6e-7 to 1.1e-6)."""
    ulp = torch.finfo(torch.float32).eps
    for key, r in cases(results, "conv", "float32").items():
        assert r["weight_grad"] == r["bias_grad"] == 0, (key, r)
        assert r["output"] <= 16 * ulp * r["output_scale"], (key, r)
        assert r["input_grad"] <= 16 * ulp * r["input_grad_scale"], (key, r)
        assert r["output_not_cl"] == 0 and r["input_grad_not_cl"] == 0, (key, r)
        assert r["conversions"] == [], key
        assert r["overlapped"] == ("overlap=True" in key), key


def test_dist_conv3d_in_float64_equals_the_contiguous_layer(results):
    """Outputs, input and weight gradients exact; the bias gradient sums in the gradient's
    layout order. (The layout itself is checked in float32: torch's float64 CPU convolution
    has no channels_last kernel and returns contiguous tensors, for a plain ``Conv3d`` too.)"""
    for key, r in cases(results, "conv", "float64").items():
        assert r["output"] == r["input_grad"] == r["weight_grad"] == 0, (key, r)
        assert r["bias_grad"] < 1e-13, (key, r)

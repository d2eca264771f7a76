"""On a GPU, one rank over NCCL (``cuda:0``, world of one): a ``DistConv3d`` built with every
default (weights on the CPU, broadcast on: they travel through the GPU) runs under bf16
autocast, and ``DistBatchNorm3d`` under ``torch.autocast("cuda", bf16)`` passes the CPU test's
checks (tests/test_trainer_norm_bf16.py) against torch's float64, float32 and cuDNN bf16
``BatchNorm3d``. One job (tests/trainer_jobs/norm_bf16_job.py ... cuda). Skipped without CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_trainer_norm_bf16 import ENV, JOB, check_bn, check_conv_defaults

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def nccl_rank(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("norm_bf16_cuda") / "out.json"
    cmd = [sys.executable, str(JOB), str(out), "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())["0"]
    assert r["backend"] == "nccl", r
    return r


def test_default_built_dist_conv3d_over_nccl_cuda(nccl_rank):
    """The broadcast runs in a world of one too, so this is the path that raised for every
    world > 1 before (CPU tensors over NCCL): now through a copy on ``cuda:0``."""
    check_conv_defaults(nccl_rank["conv defaults"])


def test_dist_batchnorm_under_cuda_bf16_autocast_is_torch_batchnorm_in_float32(nccl_rank):
    check_bn(nccl_rank["bn whole"])

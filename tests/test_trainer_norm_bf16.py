"""``DistBatchNorm3d`` under bf16 autocast computes in float32 and returns bf16; ``DistConv3d``
built with its defaults broadcasts its weights wherever the backend moves them.

The pure rules in one process, then two real ``mpiexec`` ranks on gloo
(tests/trainer_jobs/norm_bf16_job.py): default-built layers equal rank 0's, and batch norm of
a bf16 input, split in two along depth or whole, against ``torch.nn.BatchNorm3d`` of the whole
sample in float64 on the same bf16 values, in float32 and under the same autocast. The CUDA
twin (NCCL, one GPU) is tests/test_trainer_norm_bf16_cuda.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MPIEXEC

from staging.cluster import LAUNCH_ENV
from trainer.layers import travel_device
from trainer.norm import compute_dtype

ROOT = Path(__file__).parent.parent
JOB = ROOT / "tests" / "trainer_jobs" / "norm_bf16_job.py"
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    OMP_NUM_THREADS="1",
)


def test_half_inputs_compute_in_float32_and_wider_ones_in_their_own():
    assert compute_dtype(torch.bfloat16) == compute_dtype(torch.float16) == torch.float32
    assert compute_dtype(torch.float32) == torch.float32
    assert compute_dtype(torch.float64) == torch.float64


def test_a_cpu_tensor_travels_over_nccl_on_the_rank_gpu_and_stays_put_otherwise():
    gpu = torch.device("cuda", 1)
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert travel_device(cpu, "nccl", gpu) == gpu
    assert travel_device(cpu, "gloo", gpu) == torch.device("cpu")
    assert travel_device(cpu, "cpu:gloo,cuda:nccl", gpu) == torch.device("cpu")
    assert travel_device(meta, "nccl", gpu) == meta.device  # not on the CPU: where it lies
    with pytest.raises(ValueError, match="CPU tensor over NCCL needs the rank's GPU"):
        travel_device(cpu, "nccl", None)


def check_conv_defaults(r: dict) -> None:
    """A default-built ``DistConv3d``: rank 0's weights everywhere, a bf16 forward."""
    assert r["params_from_rank0"] == 0.0, r
    assert r["out_dtype"] == "torch.bfloat16" and r["out_finite"], r


def check_bn(r: dict) -> None:
    """``DistBatchNorm3d`` of a bf16 input under autocast, against torch (see the job)."""
    bf16 = "torch.bfloat16"
    assert r["out_dtype"] == r["input_grad_dtype"] == r["eval_out_dtype"] == bf16, r
    assert r["torch_autocast_out_dtype"] == bf16, r  # what torch's own BatchNorm3d returns
    assert r["buffer_dtypes"] == ["torch.float32"], r
    # in half bf16 ulps: outputs and input gradient are the exact values rounded once (<= 1);
    # the evaluation output (torch's kernel on our running statistics) and torch's own bf16
    # BatchNorm3d within one ulp (2, and float32 slack)
    assert r["out_units"] <= 1.0 and r["input_grad_units"] <= 1.0, r
    assert r["eval_out_units"] <= 2.5 and r["out_units_vs_torch_autocast"] <= 2.5, r
    # float32 running statistics: the exact ones rounded once; torch's float32 BatchNorm3d of
    # the same bf16 values within float32 tolerance (a bf16 mean or variance is off by ~1e-3)
    assert r["running_mean_rel_exact"] < 1e-6 and r["running_var_rel_exact"] < 1e-6, r
    assert r["running_mean_rel_fp32"] < 1e-5 and r["running_var_rel_fp32"] < 1e-5, r
    # float32 gamma and beta gradients: float32 sums of bf16 products (~1e-3 before)
    assert r["weight_grad_rel"] < 1e-5 and r["bias_grad_rel"] < 1e-5, r


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    assert MPIEXEC, "mpiexec not found next to the interpreter (pip install mpich)"
    out = tmp_path_factory.mktemp("norm_bf16") / "out.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(JOB), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


@pytest.mark.mpi
def test_default_built_dist_conv3d_has_rank0_weights_on_every_rank(two_ranks):
    for r in two_ranks.values():
        assert r["backend"] == "gloo"
        check_conv_defaults(r["conv defaults"])
    assert two_ranks["1"]["conv defaults"]["own_init_from_rank0"] > 0  # seeds differed


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["bn split", "bn whole"])
def test_dist_batchnorm_under_bf16_autocast_is_torch_batchnorm_in_float32(two_ranks, case):
    for r in two_ranks.values():
        check_bn(r[case])

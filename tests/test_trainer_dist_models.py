"""Models built with ``DistLayers`` under real ``mpiexec`` ranks equal the single-process models
on the whole batch: CosmoFlow's outputs and reduced gradients, a U-Net's output blocks and
gradients (BatchNorm over the world), over two SGD steps, in float64."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPIEXEC

from staging.cluster import LAUNCH_ENV

pytestmark = pytest.mark.mpi

JOBS = Path(__file__).parent / "trainer_jobs"
ROOT = Path(__file__).parent.parent
ENV = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
ENV.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
TOL = 1e-5


@pytest.mark.parametrize("n", [2, 4])
def test_dist_layers_equal_single_process(n, tmp_path):
    out = tmp_path / "out.json"
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py"]
    cmd += [str(JOBS / "dist_model_job.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    want = {
        2: ["parts=(2, 1, 1), data=1"],
        4: ["parts=(2, 1, 1), data=2", "parts=(2, 2, 1), data=1"],
    }
    assert sorted(results) == want[n]
    for case, checks in results.items():
        assert len(checks) == 8, case
        for check, err in checks.items():
            assert err < TOL, f"{case}: {check} off by {err}"

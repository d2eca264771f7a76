"""The MPI link between services: a reply that comes after its request gave up is never taken
for the answer to a later request on the same tag (real ``mpiexec`` ranks, tags wrapping every
3 requests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MPIEXEC

from staging.cluster import LAUNCH_ENV

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("no_stale_mpich_shm")]

JOB = Path(__file__).parent / "mpi_jobs" / "peer_tags_job.py"
ROOT = Path(__file__).parent.parent


def test_late_replies_never_answer_later_requests(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = tmp_path / "got.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(JOB), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert got["first"] == "UNAVAILABLE" and got["first_fetch"] == "UNAVAILABLE"
    assert got["asks"] == [0, 1, 2, 3, 4, 5]  # not "late" where the tags came round
    assert got["fetches"] == [[20], [21], [22], [23]]  # not the late fetch's 7s

"""The MPI link between services sends a fetch reply straight from the owner's arrays, as
contiguous runs of them (a box of short runs packed): exactly the bytes inside the boxes arrive,
in order (real ``mpiexec`` ranks)."""

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

JOB = Path(__file__).parent / "mpi_jobs" / "peer_pieces_job.py"
ROOT = Path(__file__).parent.parent


def test_pieces_arrive_exactly_and_in_order(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = tmp_path / "got.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(JOB), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert got["same"]
    # x: 2 x (3 x 4 x 5) float32, y: 2 x 7 int16, z: 2 x (3 x 140 x 128) float32
    assert got["nbytes"] == got["received"] == 2 * 240 + 2 * 14 + 2 * 3 * 140 * 128 * 4
    assert got["runs"] == [2 + 2 + 2 * 3]  # x packed per sample, y whole, z's runs as stored

"""The MPI link between services sends a fetch reply straight from the owner's arrays, as
contiguous runs of them (a box of short runs packed): exactly the bytes inside the boxes arrive,
in order (real ``mpiexec`` ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mpi_job, run_job

pytestmark = pytest.mark.mpi

JOB = Path(__file__).parent / "mpi_jobs" / "peer_pieces_job.py"


def test_pieces_arrive_exactly_and_in_order(tmp_path):
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    assert got["same"]
    # x: 2 x (3 x 4 x 5) float32, y: 2 x 7 int16, z: 2 x (3 x 140 x 128) float32
    assert got["nbytes"] == got["received"] == 2 * 240 + 2 * 14 + 2 * 3 * 140 * 128 * 4
    # x packed per sample, y whole, z's runs as stored
    assert got["messages"] == [[240, 240, 14, 14] + [140 * 128 * 4] * 6]

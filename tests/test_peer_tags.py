"""The MPI link between services: a reply that comes after its request gave up is never taken
for the answer to a later request on the same tag (real ``mpiexec`` ranks, tags wrapping every
3 requests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mpi_job, run_job

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("no_stale_mpich_shm")]

JOB = Path(__file__).parent / "mpi_jobs" / "peer_tags_job.py"


def test_late_replies_never_answer_later_requests(tmp_path):
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    assert got["first"] == "UNAVAILABLE" and got["first_fetch"] == "UNAVAILABLE"
    assert got["asks"] == [0, 1, 2, 3, 4, 5]  # not "late" where the tags came round
    assert got["fetches"] == [[20], [21], [22], [23]]  # not the late fetch's 7s

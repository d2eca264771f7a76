"""Closing the MPI link while peers still ask (real ``mpiexec`` ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mpi_job, run_job

JOB = Path(__file__).parent / "mpi_jobs" / "peer_close_job.py"


@pytest.mark.mpi
def test_a_request_arriving_while_the_link_closes_is_refused_not_left_hanging(tmp_path):
    """A request that reaches a closing service's link after its pool was shut is answered
    ``UNAVAILABLE`` "stopping" (before: the link's thread died on the shut pool, so that
    request and every other in flight waited out the timeout, then said the link is stuck)."""
    out = tmp_path / "got.json"
    got = run_job(mpi_job(1, JOB, out), out, timeout=120)
    for name, reply in got.items():
        assert "stuck" not in str(reply), (name, reply)
    code, message = got["during_close"]
    assert code == "UNAVAILABLE" and "this service is stopping" in message, message

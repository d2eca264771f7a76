"""The MPI link between services: a reply that comes after its request gave up is never taken
for the answer to a later request on the same tag (real ``mpiexec`` ranks, tags wrapping every
3 requests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mpi_job, run_job

pytestmark = pytest.mark.mpi

JOB = Path(__file__).parent / "mpi_jobs" / "peer_tags_job.py"


def test_late_replies_never_answer_later_requests(tmp_path):
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    assert got["first"] == "UNAVAILABLE" and got["first_fetch"] == "UNAVAILABLE"
    assert got["asks"] == [0, 1, 2, 3, 4, 5]  # not "late" where the tags came round
    assert got["fetches"] == [[20], [21], [22], [23]]  # not the late fetch's 7s


def test_late_bytes_of_fetches_that_gave_up_never_pass_for_an_answer(tmp_path):
    """Fetches told their sizes by an envelope give up before their bytes come (their receives
    cancelled); the bytes come later, and happen to read as the envelopes of the next request
    on each tag (an ask; a fetch whose receives went out with it). They are received aside by
    their size, the tags unused till then, and each request gets its own answer. Before, the
    next request read them as its envelope: the ask answered "forged" (and bytes that were no
    pickle raised on the link's thread, which died: every later request "the link is
    stuck")."""
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB.with_name("peer_stray_job.py"), out), out, timeout=120)
    gave_up = ["UNAVAILABLE", "node 0 did not send its blocks within 0.5 s"]
    assert got["fetches"] == [gave_up, gave_up]
    assert got["fetch_bytes"] == [[0], [0]]  # cancelled: the late bytes landed nowhere
    assert got["ask"] == ["no error", ""] and got["asked"] == ["a"]
    assert got["told"] == ["no error", ""] and got["told_bytes"] == [9]

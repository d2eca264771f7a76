"""A request the MPI link cannot post (its request no pickle, a buffer MPI refuses) fails with a
clear error naming the node, and frees its tag and the receives posted for it: later fetches get
every tag and their own bytes (real ``mpiexec`` ranks, tags wrapping every 3 requests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mpi_job, run_job

pytestmark = pytest.mark.mpi

JOB = Path(__file__).parent / "mpi_jobs" / "peer_unsent_job.py"


def test_a_request_that_cannot_be_posted_fails_clearly_and_frees_its_tag(tmp_path):
    """Before, the asker's thread raised MPI's or pickle's exception with the tag left in use
    (after three, every request waited out its timeout: "each of its 3 tags was in flight"),
    and where the link's thread posted, the exception ended that thread (every later request:
    "the link is stuck")."""
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    pickle = "could not be sent (TypeError: cannot pickle '_thread.lock' object)"
    buffer = "could not be sent (BufferError: dlpack: buffer is not writable)"
    for who in ("asker", "link"):
        want = ["ServiceError", "INTERNAL", f"node 0 was not asked: its fetch request {pickle}"]
        assert got[who + "_unpicklable"] == [want] * 6
        want = ["ServiceError", "INTERNAL", f"node 0 was not asked: its fetch request {buffer}"]
        assert got[who + "_read_only"] == [want] * 6
        refused = "could not be received (BufferError: dlpack: buffer is not writable)"
        want = ["ServiceError", "INTERNAL", f"node 0 answered, but the bytes {refused}"]
        assert got[who + "_told_read_only"] == [want] * 6
        unsent = "internal error: its reply could not be sent (TypeError: cannot pickle "
        want = ["ServiceError", "INTERNAL", f"node 0: {unsent}'_thread.lock' object)"]
        assert got[who + "_unanswerable"] == [want] * 4  # (before: the owner's link died)
        assert got[who + "_after"] == [[[v]] for v in range(20, 26)]
        assert got[who + "_failed_buffers"] == [[0]] * 6
    assert got["legs"] == [0.0] * 12  # each posted with its request: no tag held for good

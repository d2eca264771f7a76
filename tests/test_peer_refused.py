"""A fetch whose receives went out with its request and that timed out awaits its late bytes on
its data tag; an owner that then refuses it sends none: the tag is free again, whether the
refusal comes while another request waits on that slot's reply tag or while none does (real
``mpiexec`` ranks, 3 reply tags)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mpi_job, run_job

pytestmark = pytest.mark.mpi

JOB = Path(__file__).parent / "mpi_jobs" / "peer_refused_job.py"


def test_a_refusal_after_a_fetch_gave_up_frees_the_tag_its_late_bytes_held(tmp_path):
    """Before, the tag awaited bytes that never came, for good: of every three fetches at once,
    one was told its sizes by an envelope (a message and a wake-up more)."""
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    gave_up = ["UNAVAILABLE", "node 0 did not send its blocks within 1 s"]
    assert got["timed_out"] == got["timed_out_again"] == gave_up
    assert got["while_refused"] == [[[10], [11], [12]], 1]  # the third: no tag free to post on
    assert got["after_refused"] == [[[20], [21], [22]], 0]
    assert got["after_quiet_refusal"] == [[[30], [31], [32]], 0]
    assert got["refused_bytes"] == [0]

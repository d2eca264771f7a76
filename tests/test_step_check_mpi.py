"""The loader's per-step check on 2, 3 and 4 real ranks (``mpiexec -n P python -m mpi4py``,
``tests/mpi_jobs/step_check_job.py``): one reduction a step (O(log P) messages per rank, not
2 (P - 1)), with the same answers and errors as before: who stopped, where each rank started,
and, when a rank is absent, a timeout naming it."""

from __future__ import annotations

import os
import sys

import pytest
from helpers import MPIEXEC, rank_rows

JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "step_check_job.py")
SHORT = 2.0  # the job's timeout for the absent rank's case

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=[2, 3, 4])
def ranks(request, tmp_path_factory):
    """Every rank's JSON row of one ``mpiexec -n P`` run."""
    size = request.param
    out = str(tmp_path_factory.mktemp(f"check{size}") / "row")
    cmd = [MPIEXEC, "-n", str(size), sys.executable, "-m", "mpi4py", JOB, out]
    return rank_rows(cmd, out, size)


def test_the_reduction_is_the_maximum_on_every_rank(ranks):
    last = len(ranks) - 1
    assert [r["max"]["value"] for r in ranks] == [[last, 0, 7]] * len(ranks)


def test_steps_go_on_and_stop_together(ranks):
    for r in ranks:
        assert [g["value"] for g in r["go_on"]] == [False] * 5
        assert r["all_stop"]["value"] is True


def test_a_rank_that_stopped_alone_is_named_by_the_ranks_that_went_on(ranks):
    last = len(ranks) - 1
    assert ranks[last]["one_stops"]["value"] is True
    for r in ranks[:last]:
        assert r["one_stops"]["error"] == "RankMismatch"
        assert r["one_stops"]["text"].startswith(
            f"rank {last} stopped iterating before step 0 while this rank went on"
        )


def test_passes_that_start_at_different_positions_are_named_on_every_rank(ranks):
    at = ", ".join(f"rank {r} at epoch {3 if r == 0 else 2} step 0" for r in range(len(ranks)))
    for r in ranks:
        assert r["start_differs"]["error"] == "RankMismatch"
        assert r["start_differs"]["text"].startswith(
            f"ranks start iterating at different positions ({at})"
        )


def test_ranks_at_different_checks_are_refused_on_every_rank(ranks):
    assert ranks[0]["other_checks"]["text"].startswith(
        "ranks are at different checks: this rank at the start of epoch 4 (step 0), another not"
    )
    for r in ranks[1:]:
        assert r["other_checks"]["text"].startswith(
            "ranks are at different checks: this rank at the step check (step 1), another not"
        )


def test_an_absent_rank_is_named_after_the_timeout_and_the_diagnosis(ranks):
    """The reduction cannot say who is missing: past the timeout the ranks in it tell each
    other they are there (for ``min(timeout / 2, 5)`` s), and the absent one is named."""
    last = len(ranks) - 1
    for r in ranks[:last]:
        got = r["absent"]
        assert got["error"] == "ExchangeTimeout" and got["peers"] == [last] and got["step"] == 0
        assert (
            f"at step 0 did not complete within the timeout (waiting for rank {last})"
            in (got["text"])
        )
        assert SHORT <= got["seconds"] < SHORT + SHORT / 2 + 5, got

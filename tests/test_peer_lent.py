"""A fetch that fails while its bytes are still landing (a matched receive MPI cannot cancel)
keeps its buffers lent: the batch slot is not reused until no byte can land in it (real
``mpiexec`` ranks, CMA off so a large message moves a piece per progress call)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mpi_job, run_job

pytestmark = pytest.mark.mpi

JOB = Path(__file__).parent / "mpi_jobs" / "peer_lent_job.py"
NBYTES = 32 << 20


def test_a_slot_is_not_reused_while_a_failed_fetch_may_still_write_into_it(tmp_path, monkeypatch):
    """Before, the fetch was over after ``CANCEL_S`` and the slot lent again at once: the
    owner's bytes landed in the next batch (``reused`` was ``[7]``)."""
    monkeypatch.setenv("MPIR_CVAR_CH4_CMA_ENABLE", "0")  # (MPICH; other MPIs ignore it)
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    assert got["failed"] == ["UNAVAILABLE", "node 0 did not send its blocks within 0.5 s"]
    assert got["sevens_at_failure"] < NBYTES, "the bytes all came before the fetch failed"
    assert got["lent_at_once"] is None  # fenced while bytes may land
    assert got["lent_later"] == 0 and got["sevens_when_lent"] == NBYTES  # once they all did
    assert got["reused"] == [0xEE]  # nothing of the failed fetch's lands in the next batch
    assert got["after"] == [[30], [31], [32]]
    assert got["legs"] == [0.0, 0.0, 0.0]  # every tag posted on again: the receive ended
    # the link closed while the bytes came: the slot is never lent again (before, it was, and
    # the owner's bytes landed over the next batch); node 1 then ended while they still came,
    # and its process exited 0 (before, Open MPI's ``MPI_Finalize`` wrote them into freed
    # memory: a segfault)
    assert got["landed_before_close"] == 8
    assert got["closed"] == ["UNAVAILABLE", "node 0 was not asked: this service is stopping"]
    assert got["lent_after_close"] is None, got.get("after_close")

"""The MPI link between services receives a part of a sample into a box of the batch slot (a
block's part inside the volume amid its halo; strided on either side): exactly the part's bytes
land, the link zeroes the halo around it, and a reply of other bytes fails naming the node (real
``mpiexec`` ranks). The pure part (a box's messages) is tests/test_subarray.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import mpi_job, run_job

JOB = Path(__file__).parent / "mpi_jobs" / "peer_boxes_job.py"


@pytest.mark.mpi
def test_parts_land_in_their_boxes_in_place_and_nothing_around_them(tmp_path):
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    for case in ("low edge", "high edge", "middle"):
        assert got[case] == {"inside": True, "halo zeroed": True, "whole": True}, case
    # a part of short runs is packed: one message per sample and field
    assert got["messages"] == [[2 * 3 * 4 * 5 * 4] * 2 + [18] * 2,
                               [2 * 2 * 4 * 3 * 4] * 2 + [18] * 2,
                               [1 * 2 * 5 * 3 * 4] * 2 + [18] * 2]  # fmt: skip
    assert got["mismatch"] == [
        "INTERNAL", "node 0 sent 498 bytes as [480, 18], not 402 bytes in its boxes"
    ]  # fmt: skip

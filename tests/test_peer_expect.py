"""A fetch that tells its reply's message sizes (``expect``): the asker posts its receives with
the request and the owner sends the bytes with no envelope before them. The sizes the asker
computes are the owner's; an owner holding them cut otherwise recuts them, one holding other
totals refuses; late bytes never land in a later fetch (real ``mpiexec`` ranks, tags wrapping
every 3 requests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import mpi_job, run_job
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.maths.delivery import covered, covered_sizes, delivered_fields, spatial_grid
from datastore.readers.base import FieldInfo
from datastore.service.peer_link import Pieces, expect, fitted, sizes_of

JOB = Path(__file__).parent / "mpi_jobs" / "peer_expect_job.py"


def test_expect_codes_runs_of_equal_sizes():
    assert expect([8, 8, 8, 3, 8]) == [[8, 3], [3, 1], [8, 1]]
    assert sizes_of(expect([8, 8, 8, 3, 8])) == [8, 8, 8, 3, 8]
    assert expect([]) == [] and sizes_of([]) == []


def test_fitted_keeps_matching_messages_and_recuts_the_others():
    raw = [np.arange(5, dtype=np.uint8), np.arange(5, 16, dtype=np.uint8)]
    assert fitted(raw, [5, 11]) is raw
    cut = fitted(raw, [8, 8])
    assert [c.tolist() for c in cut] == [list(range(8)), list(range(8, 16))]
    assert fitted(raw, [10]) is None
    assert fitted([], []) == []


@settings(max_examples=80, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), *(st.integers(2, 40),) * 3),
    parts=st.tuples(*(st.integers(1, 3),) * 3),
    halo=st.tuples(*(st.integers(0, 2),) * 3),
    dtype=st.sampled_from(["uint8", "float32", "float64"]),
)
def test_the_sizes_an_asker_expects_are_the_owners_runs(shape, parts, halo, dtype):
    info = {
        "x": FieldInfo(name="x", dtype=np.dtype(dtype), shape=shape, spatial_axes=(1, 2, 3)),
        "y": FieldInfo(name="y", dtype=np.dtype("int64"), shape=(3,), spatial_axes=()),
    }
    try:
        grid = spatial_grid(info, {"parts": parts, "halo": halo})
    except ValueError:
        return  # a halo wider than a block: refused
    for block in range(grid.nblocks):
        for f in delivered_fields(info, grid, block):
            stored = np.zeros(f.sample_shape if f.blocked else f.shape, f.dtype)
            runs = Pieces([(stored, covered(f)[0])]).runs()
            assert list(covered_sizes(f)) == [r.nbytes for r in runs]


@pytest.mark.mpi
def test_told_fetches_land_exactly_and_late_bytes_never_in_a_later_one(tmp_path):
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    assert got["split"] == [[1], [1]]  # one message at the owner, recut into the two expected
    assert got["at_once"] == [[40], [41], [42], [43]]  # the 4th waited: no tag held by two
    assert got["short"] == ["INTERNAL", "node 0: holds 16 bytes of the fetch, not the 10 asked for"]
    assert got["refused"] == ["NOT_FOUND", "node 0: no sample 99 here"]
    assert got["short_bytes"] == got["refused_bytes"] == [[0]]  # nothing written
    assert got["timed_out"][0] == "UNAVAILABLE" and "within 0.5 s" in got["timed_out"][1]
    assert got["abandoned"] == [True, "UNAVAILABLE", "node 0 was no longer waited for"]
    assert got["while_no_tag_is_free"] == [[[20]], [[21]], [[22]]]
    assert got["late_bytes_landed"] == [[0], [0], [0]]  # taken aside, not into their buffers
    assert got["after"] == [[[30]], [[31]], [[32]], [[33]]]  # not the late 7s, 9s or 11s
    legs = got["legs"]  # in the order they ended: split, the 4 at once, 20-22, 30-33
    assert len(legs) == 12 and legs[:5] == [0.0] * 5 and legs[8:] == [0.0] * 4
    assert all(leg > 0 for leg in legs[5:8])  # told their sizes by an envelope
    # no receives to post: it waits for node 0's answer (before, it was over at once, ok)
    assert got["empty_refused"] == ["NOT_FOUND", "node 0: no sample 99 here"]

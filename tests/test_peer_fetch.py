"""Fetches between services: a reply's runs land in the batch's own buffers, a peer that hangs
or dies mid-transfer fails the fetch within its timeout naming the node, an abandoned fetch
ends at once and its late reply is dropped (real ``mpiexec`` ranks); and the pure parts: where
each run lands, the gRPC link's chunk filler, the time a link was in flight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import mpi_job, run_job

from datastore.service.grpc_peers import _Filler
from datastore.service.peer_link import cut_into
from datastore.service.peer_stats import ExchangeStats, read_stats

JOB = Path(__file__).parent / "mpi_jobs" / "peer_faults_job.py"


@pytest.mark.mpi
def test_a_hanging_or_dying_peer_fails_the_fetch_and_abandoned_replies_are_dropped(tmp_path):
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    assert got["hangs"] == ["UNAVAILABLE", "node 0 did not answer fetch within 0.5 s"]
    assert got["dies"] == ["UNAVAILABLE", "node 0 did not send its blocks within 0.5 s"]
    assert got["abandoned_waits"] is True
    assert got["abandoned"] == ["UNAVAILABLE", "node 0 was no longer waited for"]
    assert got["last"] == [[0, 1, 2], [3, 4, 5, 6, 7]]  # its own reply, not the late 3s
    assert got["late_bytes_landed"] == [0] * 8  # nothing landed after it was abandoned


def test_runs_land_in_the_buffers_they_fall_in():
    assert cut_into([4, 2, 6], [6, 6]) == [(0, 0, 4), (0, 4, 6), (1, 0, 6)]
    assert cut_into([3], [1, 2]) is None  # a run straddling two buffers
    assert cut_into([4], [6]) is None  # fewer bytes than the buffers hold
    assert cut_into([4, 4], [4]) is None  # more


def test_the_chunk_filler_writes_across_buffers_in_order():
    bufs = [np.zeros(3, np.uint8), np.zeros(4, np.uint8)]
    fill = _Filler(bufs)
    assert fill.put(np.arange(1, 6, dtype=np.uint8))
    assert not fill.put(np.arange(3, dtype=np.uint8))  # 8 bytes into 7: refused, none written
    assert fill.put(np.array([6, 7], np.uint8))
    assert [b.tolist() for b in bufs] == [[1, 2, 3], [4, 5, 6, 7]] and fill.at == 7


def test_the_link_counts_the_time_any_fetch_was_in_flight(tmp_path):
    clock = iter([10.0, 14.0, 20.0, 21.0])  # read as the first starts and the last ends
    stats = ExchangeStats(str(tmp_path / "peer{node}.json"), 3, clock=lambda: next(clock))
    stats.begin()  # 10
    stats.begin()  # (overlaps)
    stats.end(5, [5], (1.0, 2.0))
    stats.end(7, [3, 4], (0.5, 0.25))  # 14: none in flight: 10..14
    stats.begin()  # 20
    stats.end(0, [])  # 21: failed, no bytes
    saved = read_stats(str(tmp_path / "peer3.json"))
    assert stats.in_flight_s == saved["in_flight_s"] == 5.0
    assert saved["bytes"] == 12 and saved["spans"] == [[10.0, 14.0], [20.0, 21.0]]
    assert saved["fetches"] == [[5], [3, 4]]
    assert saved["legs"] == [[1.0, 2.0], [0.5, 0.25]]  # (envelope, bytes) s of each fetch


def test_peer_stats_close_their_file_and_record_nothing_after(tmp_path):
    """A service's stats file is closed with its link; a fetch ending later (a gRPC fetch
    still in flight at close) must not reopen it, which would truncate what was recorded."""
    from datastore.service.peer_stats import ExchangeStats

    stats = ExchangeStats(str(tmp_path / "s{node}.jsonl"), 0)
    stats.begin()
    stats.end(8, [8])
    stats.begin()
    stats.close()
    stats.end(4, [4])
    recorded = read_stats(str(tmp_path / "s0.jsonl"))
    assert (recorded["bytes"], recorded["fetches"]) == (8, [[8]]), recorded

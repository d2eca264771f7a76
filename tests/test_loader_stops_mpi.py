"""Ranks that stop early, or stop answering, raise a clear error on every rank within the
timeout, never hang (issue 11, trap 6): real ``mpiexec -n 2`` ranks
(``tests/mpi_jobs/traps_job.py``, ``traps_epochs_job.py``, ``slow_sender_job.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import MPIEXEC
from mpi_traps import EPOCHS_JOB, N, alone, write_data

from datastore.maths.order import Schedule

SLOW_JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "slow_sender_job.py")

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return write_data(tmp_path_factory.mktemp("trapsmpi"))


def test_6_a_rank_that_goes_on_while_another_stopped_gets_an_error_not_a_hang(data):
    job = alone("stop", data[0])  # timeout=5, 8 steps; rank 1 breaks after its first batch
    first = Schedule(N, 2, seed=1).order(0).reshape(-1, 2)
    zero, one = job.rows
    assert one["error"] is None and one["ids"] == [first[0][1:].tolist()]
    kind, text = zero["error"]
    assert kind == "RankMismatch" and text.startswith("rank 1 stopped iterating before step")
    # told by the stop protocol: waiting out the 5 s timeout would give an ExchangeTimeout
    # what rank 0 got before the error: the schedule's first batches, exact bytes
    assert 1 <= len(zero["ids"]) < len(first)
    assert zero["ids"] == [s[:1].tolist() for s in first[: len(zero["ids"])]]
    assert zero["bad_bytes"] == 0 and one["bad_bytes"] == 0
    assert f"before step {len(zero['ids'])} " in text
    assert job.raised(0, "datastore.errors.RankMismatch: rank 1 stopped iterating")


def test_6_ranks_that_stop_together_go_on_together(data):
    job = alone("both_stop", data[0])
    order = [Schedule(N, 4, seed=1).order(e).reshape(-1, 4) for e in range(2)]
    for r in job.rows:
        assert r["error"] is None
        half = slice(2 * r["rank"], 2 * r["rank"] + 2)
        want = [s[half].tolist() for s in order[0][:2]] + [s[half].tolist() for s in order[1]]
        assert r["ids"] == want
        assert r["bad_bytes"] == 0


@pytest.fixture(scope="module")
def silent(data):
    """Rank 1 builds its loader, then never iterates; rank 0 iterates with timeout=3."""
    return alone("silent", data[0])


def test_6_a_peer_that_stops_answering_gives_a_timeout_within_seconds(silent):
    zero, one = silent.rows
    assert one["error"] is None and one["ids"] == []
    kind, text = zero["error"]
    assert kind == "ExchangeTimeout" and zero["timeout_error"]  # also a TimeoutError
    assert 3 <= zero["seconds"] < 10
    assert zero["ids"] == []
    assert zero["step"] == 0 and "step 0" in text
    assert silent.raised(0, "datastore.errors.ExchangeTimeout")


@pytest.fixture(scope="module")
def stall(data):
    """8 steps, timeout=3: rank 1 takes one batch, then holds its loop without asking for the
    next; rank 0 goes on."""
    return alone("stall", data[0])


def test_6_a_peer_that_stops_asking_mid_epoch_gives_a_timeout_within_seconds(stall):
    zero, one = stall.rows
    first = Schedule(N, 2, seed=1).order(0).reshape(-1, 2)
    assert one["error"] is None and one["ids"] == [first[0][1:].tolist()]
    kind, text = zero["error"]
    assert kind == "ExchangeTimeout" and zero["timeout_error"]
    assert 3 <= zero["seconds"] < 10
    # rank 0 took the batches the peer's prefetch had already exchanged, then timed out
    steps = len(zero["ids"])
    assert 1 <= steps < len(first) and zero["ids"] == [s[:1].tolist() for s in first[:steps]]
    assert zero["bad_bytes"] == 0
    assert zero["step"] == steps and f"at step {steps} " in text


@pytest.mark.parametrize("case", ["silent", "stall"])
def test_6_the_timeout_names_the_peer_that_stopped_answering(request, case):
    zero = request.getfixturevalue(case).rows[0]
    assert zero["error"][0] == "ExchangeTimeout"
    assert zero["peers"] == [1], zero  # ExchangeTimeout.peer: the rank still awaited
    assert "rank 1" in zero["error"][1]


def test_6_a_peer_slow_to_send_gives_a_timeout_and_a_clean_exit(tmp_path, monkeypatch):
    """Rank 1 passes a step's check, then reads a sample for 4 s (timeout 2 s): rank 0 times
    out in the exchange naming it, and both processes exit 0, rank 1's bytes landing while
    rank 0 finalizes (before, Open MPI wrote them into freed memory: a segfault after the
    error); a new pass on rank 0 is refused at once. 442 KiB samples: a message moves in
    pieces, not at once."""
    monkeypatch.setenv("MPIR_CVAR_CH4_CMA_ENABLE", "0")  # (MPICH; Open MPI: helpers.py's)
    path = tmp_path / "big.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(5).standard_normal((32, 1, 48, 48, 48), dtype=np.float32)
    out = tmp_path / "slow"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", SLOW_JOB, str(path), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    zero, one = (json.loads((tmp_path / f"slow.{r}.json").read_text()) for r in (0, 1))
    step = zero["steps"]  # the batches it took before the slow one
    assert step >= 1 and zero["error"][0] == "ExchangeTimeout"
    assert zero["error"][1].startswith(
        f"the MPI exchange at step {step} did not complete within the timeout (waiting for rank 1)"
    )
    assert one["error"][0] == "ExchangeTimeout" and "(waiting for rank 0)" in one["error"][1]
    # a new pass on rank 0: refused at once (the old step's blocks may still come, matched
    # to its receives or in place of a later step's), not a start check that waits
    kind, text, seconds = zero["again"]
    assert kind == "DataStoreError" and seconds < 1.0
    assert text == (
        f"the mpi exchange failed at step {step} and cannot be used again (messages of that "
        "step may still arrive): make a new loader"
    )


# -- 6, the next epoch after a peer stopped ---------------------------------------------------
TIMEOUT = 5.0  # traps_epochs_job.py's


def check_stopped_epoch(zero: dict, one: dict) -> int:
    """Epoch 0: rank 1 took one batch and broke; rank 0 got the schedule's first batches with
    the right bytes, then a RankMismatch naming rank 1 and the step (the stop protocol's error,
    not the timeout's).
    Returns K, the batches rank 0 took (its position is epoch 0, step K)."""
    first = Schedule(N, 2, seed=1).order(0).reshape(-1, 2)
    t0, t1 = zero["tries"][0], one["tries"][0]
    assert t1["error"] is None and t1["ids"] == [first[0][1:].tolist()] and t1["bad"] == 0
    assert t1["position"] == [0, 1]
    k = len(t0["ids"])
    assert 1 <= k < len(first)
    assert t0["ids"] == [s[:1].tolist() for s in first[:k]] and t0["bad"] == 0
    err = t0["error"]
    assert err["kind"] == "RankMismatch" and err["value_error"]
    assert err["text"].startswith(f"rank 1 stopped iterating before step {k} while this rank")
    assert t0["position"] == [0, k]
    return k


def test_6_going_on_to_the_next_epoch_after_a_peer_stopped_times_out_naming_it(data):
    """Rank 1 breaks after its first batch, then never iterates again (it stays alive); rank 0
    tries the epoch, then the next. What is asserted: rank 0's first try ends with the stop
    protocol's RankMismatch (the loader's rule: ranks stop at the same step or the one that
    went on is told); its second try (a new pass: epoch 1 from step 0) waits at the start
    check for rank 1 and gets an ExchangeTimeout (a TimeoutError) naming step 0 and rank 1
    within 1-2x ``timeout``: no hang, no batch, and its position is that pass's start."""
    job = alone("stop_idle", data[0], job=EPOCHS_JOB)
    zero, one = job.rows
    assert zero["error"] is None and one["error"] is None
    assert len(one["tries"]) == 1 and len(zero["tries"]) == 2
    check_stopped_epoch(zero, one)
    again = zero["tries"][1]
    assert again["ids"] == [] and again["position"] == [1, 0]
    err = again["error"]
    assert err["kind"] == "ExchangeTimeout" and err["timeout_error"]
    assert err["step"] == 0 and err["peers"] == [1]
    assert "at step 0 " in err["text"] and "rank 1" in err["text"]
    assert TIMEOUT <= err["seconds"] < 2 * TIMEOUT
    assert job.raised(0, "datastore.errors.ExchangeTimeout: the start of epoch 1 at step 0")


def test_6_ranks_that_both_go_on_after_a_stop_are_told_at_once(data):
    """Both ranks loop over 2 epochs; rank 1 breaks after its first batch each time. Each
    iter() is a new pass, so the second starts epoch 1 from step 0 on both ranks, wherever
    each stopped in epoch 0: rank 1 takes epoch 1's first batch and breaks again, and rank 0
    is told by the stop protocol as in the first try, at once."""
    job = alone("stop_again", data[0], job=EPOCHS_JOB)
    zero, one = job.rows
    assert zero["error"] is None and one["error"] is None
    assert len(one["tries"]) == len(zero["tries"]) == 2
    check_stopped_epoch(zero, one)
    z, o = zero["tries"][1], one["tries"][1]
    assert z["bad"] == o["bad"] == 0
    second = Schedule(N, 2, seed=1).order(1).reshape(-1, 2)
    assert o["error"] is None and o["ids"] == [second[0][1:].tolist()] and o["position"] == [1, 1]
    k2 = len(z["ids"])
    assert 1 <= k2 < len(second) and z["ids"] == [s[:1].tolist() for s in second[:k2]]
    assert z["error"]["kind"] == "RankMismatch" and z["position"] == [1, k2]
    assert z["error"]["text"].startswith(f"rank 1 stopped iterating before step {k2} ")

"""Ranks that disagree or stop early raise the same clear error on every rank, never hang
(issue 11, traps 6, 9, 10): real ``mpiexec -n 2`` ranks (``tests/mpi_jobs/traps_job.py``).
Traps 1, 3, 4 and 12 again through the MPI exchange, over epochs, and a rank that goes on to
the next epoch after its peer stopped (``tests/mpi_jobs/traps_epochs_job.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import MPIEXEC

from datastore.maths.order import Schedule

JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "traps_job.py")
EPOCHS_JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "traps_epochs_job.py")
SLOW_JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "slow_sender_job.py")
N, D = 16, 8

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """``a.h5`` (N samples) and ``b.h5`` (N + 4): random ``x`` volumes (D voxels wide) and
    ``idx``; ``c.h5``: N samples 2 voxels wide."""
    tmp = tmp_path_factory.mktemp("trapsmpi")
    rng = np.random.default_rng(5)
    paths = []
    for name, n, d in (("a.h5", N, D), ("b.h5", N + 4, D), ("c.h5", N, 2)):
        with h5py.File(tmp / name, "w") as f:
            f["x"] = rng.standard_normal((n, 1, d, d, d), dtype=np.float32)
            f["idx"] = np.arange(n, dtype=np.int64)
        paths.append(str(tmp / name))
    return paths


class Job:
    """One ``mpiexec -n 2`` run of ``job`` over ``cases``, one after the other in the same
    ranks (a launch per case cost about 5 s each, mostly ``import torch`` on every rank)."""

    def __init__(self, cases: list[str], *paths: str, job: str = JOB) -> None:
        out = os.path.dirname(paths[0])
        cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", job, ",".join(cases), out]
        proc = subprocess.run(
            [*cmd, *paths], capture_output=True, text=True, timeout=60 + 10 * len(cases)
        )  # a hang fails here
        assert proc.returncode == 0, proc.stderr[-3000:]
        self.cases = {case: Case(case, out, proc.stderr.splitlines()) for case in cases}

    def __getitem__(self, case: str) -> Case:
        return self.cases[case]


class Case:
    """One case of a :class:`Job`: each rank's JSON row, and the stderr lines tagged with it."""

    def __init__(self, case: str, out: str, stderr: list[str]) -> None:
        self.rows = []
        for rank in range(2):
            with open(os.path.join(out, f"{case}.{rank}.json")) as f:
                self.rows.append(json.load(f))
        self.stderr = {r: [ln for ln in stderr if ln.startswith(f"[{r}:{case}]")] for r in (0, 1)}
        self.case = case

    def raised(self, rank: int, line: str) -> bool:
        """Whether ``rank``'s stderr shows a traceback ending in ``line``."""
        return any(ln.startswith(f"[{rank}:{self.case}] {line}") for ln in self.stderr[rank])


def alone(case: str, *paths: str, job: str = JOB) -> Case:
    """A launch of ``case`` alone (one that leaves a rank waiting, or times out)."""
    return Job([case], *paths, job=job)[case]


# every rank refuses these before it communicates a batch: one launch runs them all
REFUSALS = ["seed", "batch", "spatial", "fields", "dataset", "halo", "halo_axis", "one_bad",
            "one_bad_geometry", "one_bad_parts", "parts_world"]  # fmt: skip


@pytest.fixture(scope="module")
def refusals(data) -> Job:
    return Job(REFUSALS, *data)


@pytest.mark.parametrize(
    ("case", "argument", "values"),
    [
        ("seed", "seed", ("0", "1")),
        ("batch", "batch_size", ("2", "3")),
        ("spatial", "spatial", ("(0, 0, 0)", "(1, 1, 1)")),
        ("fields", "fields", ("('x', 'idx')", "('idx',)")),
    ],
)
def test_9_ranks_that_disagree_all_raise_naming_the_argument_and_ranks(
    refusals, case, argument, values
):
    job = refusals[case]
    for r in job.rows:
        kind, text = r["error"]
        assert kind == "RankMismatch", r
        assert f"disagree on {argument}" in text
        assert "ranks 0: " in text and "ranks 1: " in text
        assert all(v in text for v in values), text
        assert r["ids"] == []
    for rank in (0, 1):  # each rank's own traceback
        assert job.raised(rank, f"datastore.errors.RankMismatch: ranks disagree on {argument}")


def test_9_a_dataset_that_differs_between_ranks_is_named(refusals):
    job = refusals["dataset"]
    for r in job.rows:
        kind, text = r["error"]
        assert kind == "RankMismatch" and "disagree on dataset" in text
        assert f"ranks 0: {N} samples" in text and f"ranks 1: {N + 4} samples" in text
    for rank in (0, 1):
        assert job.raised(rank, "datastore.errors.RankMismatch: ranks disagree on dataset")


def test_10_a_geometry_that_cannot_work_is_refused_on_every_rank_alike(refusals):
    job = refusals["halo"]
    assert job.rows[0]["error"] == job.rows[1]["error"]
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError" and "halo" in text


def test_10_a_halo_wider_than_a_block_is_refused_on_every_rank_alike(refusals):
    job = refusals["halo_axis"]  # D=8 in 4 parts: blocks of 2 voxels, halo 3
    assert job.rows[0]["error"] == job.rows[1]["error"]
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError"
    assert text.startswith("halo[0]=3 is wider than the smallest neighbouring block (2 voxels")
    for rank in (0, 1):
        assert job.raised(rank, "ValueError: halo[0]=3 is wider")


def test_10_one_rank_with_a_bad_argument_takes_both_down(refusals):
    job = refusals["one_bad"]
    kind, text = job.rows[1]["error"]
    assert kind == "ValueError" and text == "prefetch must be an int >= 1, got 0"
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError" and text == "rank 1 refused: prefetch must be an int >= 1, got 0"
    assert job.raised(0, "ValueError: rank 1 refused: prefetch")
    assert job.raised(1, "ValueError: prefetch must be an int >= 1")


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


# -- 10, one rank alone: geometry refused on every rank -------------------------------------
def test_10_one_rank_whose_geometry_cannot_work_takes_both_down(refusals):
    """Same arguments on both ranks (parts (2, 1, 1), halo 2), but rank 1's volumes are 2
    voxels wide: only rank 1 finds halo 2 wider than its blocks of 1; rank 0 raises too."""
    job = refusals["one_bad_geometry"]
    want = "halo[0]=2 is wider than the smallest neighbouring block (1 voxels"
    kind, text = job.rows[1]["error"]
    assert kind == "ValueError" and text.startswith(want), text
    kind, zero = job.rows[0]["error"]
    assert kind == "ValueError" and zero == f"rank 1 refused: {text}"
    assert all(r["ids"] == [] for r in job.rows)
    assert job.raised(0, f"ValueError: rank 1 refused: {want}")
    assert job.raised(1, f"ValueError: {want}")


def test_10_one_rank_asking_for_other_parts_is_a_mismatch_on_both(refusals):
    job = refusals["one_bad_parts"]  # rank 1 alone: parts (3, 1, 1)
    assert job.rows[0]["error"] == job.rows[1]["error"]
    kind, text = job.rows[0]["error"]
    assert kind == "RankMismatch" and text.startswith("ranks disagree on spatial: ranks 0: ")
    assert "'parts': (2, 1, 1)" in text and "ranks 1: {'parts': (3, 1, 1)" in text


def test_10_parts_the_ranks_cannot_hold_are_refused_on_both(refusals):
    job = refusals["parts_world"]  # parts (3, 1, 1) on 2 ranks, on both
    for r in job.rows:
        assert r["error"] == ["ValueError", "world size 2 is not a multiple of 3 spatial blocks"]
        assert r["ids"] == []


# -- 1, 3, 4, 12 through the MPI exchange, over epochs ----------------------------------------
def padded_order(seed: int, epoch: int, global_batch: int) -> np.ndarray:
    """The epoch's permutation, its tail padded with its first samples: (steps, global_batch)."""
    perm = Schedule(N, 1, seed=seed).order(epoch)
    pad = -N % global_batch
    return np.concatenate([perm, perm[:pad]]).reshape(-1, global_batch)


@pytest.fixture(scope="module")
def consumed(data) -> Job:
    return Job(["consume_spatial", "consume_data"], data[0], job=EPOCHS_JOB)


@pytest.mark.parametrize("case", ["consume_spatial", "consume_data"])
def test_1_3_4_12_over_the_mpi_exchange(consumed, case):
    """3 epochs as ``islice(loader, len(loader))`` each, no set_epoch (1): epochs 0, 1, 2 in
    the schedule's order, the position moving on at each epoch's last batch. Every batch holds
    the file's bytes (with spatial: the whole box, zero border included, cut by np.pad here).
    Epoch 0's batches are kept and still hold their bytes after epochs 1 and 2 (3); epochs 1
    and 2 are edited in place (``x.mul_(0).add_(7)``, ``idx.mul_(0)``) and no edit reaches a
    later batch (12). ``consume_data``: global batch 6 over 16 samples, drop_last=False: the
    exact ``valid`` mask (4)."""
    job = consumed[case]
    spatial = case == "consume_spatial"
    gb = 2 if spatial else 6
    steps = N // gb if spatial else -(-N // gb)
    for r in job.rows:
        assert r["error"] is None, r["error"]
        assert r["source"] == "mpi" and r["len"] == steps
        assert len(r["epochs"]) == 3
        for epoch, row in enumerate(r["epochs"]):
            order = padded_order(3, epoch, gb)
            assert len(order) == steps
            share = slice(0, gb) if spatial else slice(3 * r["rank"], 3 * r["rank"] + 3)
            assert row["ids"] == order[:, share].tolist(), (r["rank"], epoch)
            assert row["bad"] == 0, (r["rank"], epoch)
            want = [[epoch, i + 1] for i in range(steps - 1)] + [[epoch + 1, 0]]
            assert row["positions"] == want
            assert row["after"] == [epoch + 1, epoch + 1, 0]
            if spatial:
                assert row["valid"] == []
            else:
                assert row["valid"] == [
                    [step * gb + share.start + j < N for j in range(3)] for step in range(steps)
                ]
        assert r["kept"] == steps and r["kept_bad"] == 0
    if not spatial:  # the real samples of both ranks: the dataset once per epoch
        for epoch in range(3):
            row = [r["epochs"][epoch] for r in job.rows]
            real = [
                i
                for rr in row
                for ids, mask in zip(rr["ids"], rr["valid"], strict=True)
                for i, m in zip(ids, mask, strict=True)
                if m
            ]
            assert sorted(real) == list(range(N))
        assert job.rows[1]["epochs"][0]["valid"][-1] == [True, False, False]


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

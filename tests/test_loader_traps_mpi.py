"""Ranks that disagree or stop early raise the same clear error on every rank, never hang
(issue 11, traps 6, 9, 10): real ``mpiexec -n 2`` ranks (``tests/mpi_jobs/traps_job.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from helpers import MPIEXEC

from datastore.order import Schedule

JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "traps_job.py")
N, D = 16, 8

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("no_stale_mpich_shm")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """``a.h5`` (N samples) and ``b.h5`` (N + 4): random ``x`` volumes and ``idx``."""
    tmp = tmp_path_factory.mktemp("trapsmpi")
    rng = np.random.default_rng(5)
    paths = []
    for name, n in (("a.h5", N), ("b.h5", N + 4)):
        with h5py.File(tmp / name, "w") as f:
            f["x"] = rng.standard_normal((n, 1, D, D, D), dtype=np.float32)
            f["idx"] = np.arange(n, dtype=np.int64)
        paths.append(str(tmp / name))
    return paths


class Job:
    """One ``mpiexec -n 2`` run of the job: each rank's JSON row and stderr lines."""

    def __init__(self, case: str, *paths: str) -> None:
        out = os.path.join(os.path.dirname(paths[0]), case)
        cmd = [MPIEXEC, "-prepend-rank", "-n", "2", sys.executable, "-m", "mpi4py", JOB, case]
        t0 = time.monotonic()
        proc = subprocess.run(
            [*cmd, out, *paths], capture_output=True, text=True, timeout=60
        )  # a hang fails here
        self.seconds = time.monotonic() - t0
        assert proc.returncode == 0, proc.stderr[-3000:]
        self.rows = []
        for rank in range(2):
            with open(f"{out}.{rank}.json") as f:
                self.rows.append(json.load(f))
        self.stderr = {
            r: [ln for ln in proc.stderr.splitlines() if ln.startswith(f"[{r}]")] for r in (0, 1)
        }

    def raised(self, rank: int, line: str) -> bool:
        """Whether ``rank``'s stderr shows a traceback ending in ``line``."""
        return any(ln.startswith(f"[{rank}] {line}") for ln in self.stderr[rank])


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
    data, case, argument, values
):
    job = Job(case, data[0])
    assert job.seconds < 30
    for r in job.rows:
        kind, text = r["error"]
        assert kind == "RankMismatch", r
        assert f"disagree on {argument}" in text
        assert "ranks 0: " in text and "ranks 1: " in text
        assert all(v in text for v in values), text
        assert r["ids"] == []
    for rank in (0, 1):  # each rank's own traceback
        assert job.raised(rank, f"datastore.errors.RankMismatch: ranks disagree on {argument}")


def test_9_a_dataset_that_differs_between_ranks_is_named(data):
    job = Job("dataset", data[0], data[1])
    for r in job.rows:
        kind, text = r["error"]
        assert kind == "RankMismatch" and "disagree on dataset" in text
        assert f"ranks 0: {N} samples" in text and f"ranks 1: {N + 4} samples" in text
    for rank in (0, 1):
        assert job.raised(rank, "datastore.errors.RankMismatch: ranks disagree on dataset")


def test_10_a_geometry_that_cannot_work_is_refused_on_every_rank_alike(data):
    job = Job("halo", data[0])
    assert job.rows[0]["error"] == job.rows[1]["error"]
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError" and "halo" in text


def test_10_a_halo_wider_than_a_block_is_refused_on_every_rank_alike(data):
    job = Job("halo_axis", data[0])  # D=8 in 4 parts: blocks of 2 voxels, halo 3
    assert job.rows[0]["error"] == job.rows[1]["error"]
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError"
    assert text.startswith("halo[0]=3 is wider than the smallest neighbouring block (2 voxels")
    for rank in (0, 1):
        assert job.raised(rank, "ValueError: halo[0]=3 is wider")


def test_10_one_rank_with_a_bad_argument_takes_both_down(data):
    job = Job("one_bad", data[0])
    kind, text = job.rows[1]["error"]
    assert kind == "ValueError" and text == "prefetch must be an int >= 1, got 0"
    kind, text = job.rows[0]["error"]
    assert kind == "ValueError" and text == "rank 1 refused: prefetch must be an int >= 1, got 0"
    assert job.raised(0, "ValueError: rank 1 refused: prefetch")
    assert job.raised(1, "ValueError: prefetch must be an int >= 1")


def test_6_a_rank_that_goes_on_while_another_stopped_gets_an_error_not_a_hang(data):
    job = Job("stop", data[0])  # timeout=5; rank 1 breaks after its first batch
    first = Schedule(N, 4, seed=1).order(0).reshape(-1, 4)
    zero, one = job.rows
    assert one["error"] is None and one["ids"] == [first[0][2:].tolist()]
    kind, text = zero["error"]
    assert kind == "RankMismatch" and text.startswith("rank 1 stopped iterating before step")
    assert zero["seconds"] < 4  # told by the stop protocol, not by the 5 s timeout
    # what rank 0 got before the error: the schedule's first batches, exact bytes
    assert 1 <= len(zero["ids"]) < len(first)
    assert zero["ids"] == [s[:2].tolist() for s in first[: len(zero["ids"])]]
    assert zero["bad_bytes"] == 0 and one["bad_bytes"] == 0
    assert f"before step {len(zero['ids'])} " in text
    assert job.raised(0, "datastore.errors.RankMismatch: rank 1 stopped iterating")


def test_6_ranks_that_stop_together_go_on_together(data):
    job = Job("both_stop", data[0])
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
    return Job("silent", data[0])


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
    return Job("stall", data[0])


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

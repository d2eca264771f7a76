"""Ranks that disagree or stop early raise the same clear error on every rank, never hang
(issue 11, traps 6, 9, 10): real ``mpiexec -n 2`` ranks."""

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

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trapsmpi")
    paths = []
    for name, n in (("a.h5", N), ("b.h5", N + 4)):
        with h5py.File(tmp / name, "w") as f:
            f["x"] = np.zeros((n, 1, D, D, D), np.float32)
            f["idx"] = np.arange(n, dtype=np.int64)
        paths.append(str(tmp / name))
    return paths


def run(case: str, *paths: str) -> list[dict]:
    out = os.path.join(os.path.dirname(paths[0]), case)
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", JOB, case, out, *paths]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # a hang fails here
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 40
    rows = []
    for rank in range(2):
        with open(f"{out}.{rank}.json") as f:
            rows.append(json.load(f))
    return rows


@pytest.mark.parametrize(
    ("case", "argument"),
    [("seed", "seed"), ("batch", "batch_size"), ("spatial", "spatial"), ("fields", "fields")],
)
def test_9_ranks_that_disagree_all_raise_naming_the_argument_and_ranks(data, case, argument):
    rows = run(case, data[0])
    for r in rows:
        kind, text = r["error"]
        assert kind == "RankMismatch", r
        assert f"disagree on {argument}" in text and "ranks 0" in text and "ranks 1" in text


def test_9_a_dataset_that_differs_between_ranks_is_named(data):
    rows = run("dataset", data[0], data[1])
    for r in rows:
        kind, text = r["error"]
        assert kind == "RankMismatch" and "disagree on dataset" in text
        assert f"{N} samples" in text and f"{N + 4} samples" in text


def test_10_a_geometry_that_cannot_work_is_refused_on_every_rank_alike(data):
    rows = run("halo", data[0])
    assert rows[0]["error"] == rows[1]["error"]
    kind, text = rows[0]["error"]
    assert kind == "ValueError" and "halo" in text


def test_10_one_rank_with_a_bad_argument_takes_both_down(data):
    rows = run("one_bad", data[0])
    assert rows[1]["error"][0] == "ValueError" and "prefetch" in rows[1]["error"][1]
    kind, text = rows[0]["error"]
    assert kind == "ValueError" and text.startswith("rank 1 refused") and "prefetch" in text


def test_6_a_rank_that_goes_on_while_another_stopped_gets_an_error_not_a_hang(data):
    rows = run("stop", data[0])
    assert rows[1]["error"] is None and len(rows[1]["ids"]) == 1
    kind, text = rows[0]["error"]
    assert kind == "RankMismatch" and "rank 1 stopped iterating" in text


def test_6_ranks_that_stop_together_go_on_together(data):
    rows = run("both_stop", data[0])
    order = [Schedule(N, 4, seed=1).order(e).reshape(-1, 4) for e in range(2)]
    for r in rows:
        assert r["error"] is None
        half = slice(2 * r["rank"], 2 * r["rank"] + 2)
        want = [s[half].tolist() for s in order[0][:2]] + [s[half].tolist() for s in order[1]]
        assert r["ids"] == want

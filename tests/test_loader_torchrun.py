"""Ranks without MPI agree on their loader's arguments whenever the loader is made (issue 22,
2c): under torchrun before ``init_process_group`` over its agent's store, after it over the
process group; launched without a store, at the first pass over the group made by then, or
refused. ``seed=rank`` is refused on every rank, naming the seeds; never a silent loss. One
launch each: ``python -m torch.distributed.run --nproc_per_node 2``, and a plain launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import wait_ranks

from staging.cluster import LAUNCH_ENV

pytestmark = pytest.mark.slow  # jobs of several processes: not in `make test-quick`

JOB = os.path.join(os.path.dirname(__file__), "dist_jobs", "seed_agree_job.py")
N, WORLD = 16, 2
SEEDS = (
    "ranks disagree on seed: ranks 0: 0; ranks 1: 1. Every rank of a job must pass the same seed"
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("seed") / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((N, 2), np.float32)
        f["idx"] = np.arange(N, dtype=np.int64)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(data: str, out: str) -> list[dict]:
    """The job under ``python -m torch.distributed.run --nproc_per_node 2``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD)]
    cmd += ["--master_port", str(free_port()), JOB, data, out]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return rows(out)


def plain(data: str, out: str) -> list[dict]:
    """The job as two processes with torchrun's variables but no agent store (a launcher that
    only sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)."""
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    base.update(WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, JOB, data, out],
            env={**base, "RANK": str(r)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    wait_ranks(procs, 120)
    return rows(out)


def rows(out: str) -> list[dict]:
    got = []
    for r in range(WORLD):
        with open(f"{out}.{r}.json") as f:
            got.append(json.load(f))
    return got


def check_covers_every_sample(got: list[dict], key: str) -> None:
    ids = []
    for row in got:
        assert row[key]["error"] is None, row[key]
        ids += [i for batch in row[key]["ids"] for i in batch]
    assert sorted(ids) == list(range(N))


def test_torchrun_ranks_with_different_seeds_are_refused_when_the_loader_is_made(data, tmp_path):
    """Before the process group over torchrun's store, after it over the group."""
    got = torchrun(data, str(tmp_path / "out"))
    for row in got:
        for when in ("before", "late", "after"):
            want = {"error": ["RankMismatch", SEEDS], "at": "made"}
            assert row[f"{when}/rank"] == want, (when, row)
    for when in ("before", "late", "after"):
        check_covers_every_sample(got, f"{when}/same")


def test_without_a_store_the_first_pass_agrees_over_the_group_or_is_refused(data, tmp_path):
    got = plain(data, str(tmp_path / "out"))
    for row in got:
        for name in ("rank", "same"):  # no group yet: refused, whatever the seeds
            kind, text = row[f"before/{name}"]["error"]
            assert (kind, row[f"before/{name}"]["at"]) == ("RuntimeError", "iter")
            assert text.startswith(
                "2 ranks (torchrun environment) but no MPI, no torch.distributed process "
                "group and no torchrun store: the ranks cannot check that they agree"
            ), text
        assert row["late/rank"] == {"error": ["RankMismatch", SEEDS], "at": "iter"}, row
        assert row["after/rank"] == {"error": ["RankMismatch", SEEDS], "at": "made"}, row
    for when in ("late", "after"):
        check_covers_every_sample(got, f"{when}/same")

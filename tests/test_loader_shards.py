"""A dataset staged with ``--mode shard``: each node's share, one global order, no re-staging."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import MPIEXEC

from datastore.maths.order import Schedule
from datastore.maths.ownership import Homes
from datastore.store.shards import owners_by_holders

JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "shard_job.py")


def test_owners_follow_the_nodes_that_hold_the_files():
    names = ["a", "b", "c", "d", "e", "f"]
    holders = [["a", "c", "e"], ["a", "c", "e"], ["b", "d", "f"], ["b", "d", "f"]]
    # ranks 0-1 share one node (a, c, e), ranks 2-3 the other: contiguous halves per node
    assert owners_by_holders(names, holders)[np.arange(6)].tolist() == [0, 2, 0, 2, 1, 3]
    # a file on two nodes goes to the first that holds it
    both = owners_by_holders(["a", "b"], [["a", "b"], ["b"]])
    assert both[np.arange(2)].tolist() == [0, 0]


@pytest.mark.mpi
def test_loader_reads_each_nodes_staged_share(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    n = 20
    for i in range(n):
        vol = np.random.default_rng(i).standard_normal((2, 4, 4, 4)).astype(np.float32)
        vol[0, 0, 0, 0] = i  # the sample's identity
        np.save(src / f"s{i:03d}.npy", vol)
    stage = [
        MPIEXEC,
        "-n",
        "2",
        sys.executable,
        "-m",
        "datastore",
        "stage",
        str(src),
        "--to",
        str(tmp_path / "node{node}"),
        "--mode",
        "shard",
        "--ranks-per-node",
        "1",
        "-q",
    ]
    assert subprocess.run(stage, timeout=120).returncode == 0
    shares = [sorted(os.listdir(tmp_path / f"node{k}" / "src")) for k in range(2)]
    assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
    out = tmp_path / "out.json"
    cmd = [
        MPIEXEC,
        "-n",
        "2",
        sys.executable,
        "-m",
        "mpi4py",
        JOB,
        str(tmp_path),
        str(src),
        str(out),
        "4",
        "global,shard",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    every = json.loads(out.read_text())
    result = every["global"]
    order = Schedule(n, 4, seed=5).order(0)
    assert result["steps"] == order.reshape(-1, 4).tolist()  # the order of one directory
    names = sorted(os.listdir(src))
    for k in range(2):  # each rank stored exactly its node's files
        assert sorted(names[i] for i in result["stored"][k]) == shares[k]
    assert sum(result["sent"]) > 0
    # shuffle="shard": each rank draws from its node's files only, and nothing is exchanged
    shard = every["shard"]
    owners = owners_by_holders(names, shares)
    homes = Homes(owners, 2)
    want = Schedule(n, 4, seed=5, shuffle="shard", homes=homes).order(0)
    assert shard["steps"] == want.reshape(-1, 4).tolist()
    for k in range(2):
        mine = [i for step in shard["steps"] for i in step[2 * k : 2 * k + 2]]
        assert {names[i] for i in mine} <= set(shares[k])
    assert shard["sent"] == [0, 0]

"""A geometry one rank refuses raises on every rank of the spatial group at once.

Two ranks over gloo as torchrun starts them (``dist_jobs/geometry_agree_job.py``), with a 60 s
halo timeout and a 30 s limit on the job: before the agreement, the rank whose block was fine
waited out the halo timeout, so a hang fails the test. The agreement's decision itself is a pure
function, checked here in one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_ranks

from staging.cluster import LAUNCH_ENV
from trainer.agree import group_refusals, refusal_message
from trainer.geometry import check_conv_block

ROOT = Path(__file__).parent.parent
JOB = Path(__file__).parent / "dist_jobs" / "geometry_agree_job.py"


def conv_check(stride, halo, parts=(2, 1, 1)):
    return lambda owned, coords: check_conv_block(owned, parts, coords, stride, halo)


def test_the_refusals_are_those_of_every_block_whoever_computes_them():
    s2 = conv_check((2, 2, 2), (1, 1, 1))
    assert group_refusals([(1, 1, 4, 4, 4), (1, 1, 5, 4, 4)], (2, 1, 1), s2) == []
    assert group_refusals([(1, 1, 5, 4, 4), (1, 1, 4, 4, 4)], (2, 1, 1), s2) == [
        (0, "DistConv3d: block 0 of 2 along split axis 0 has 5 voxels, not a multiple of the "
            "stride 2; every block but the last along a split axis must be, so that every block "
            "starts on the stride"),
    ]  # fmt: skip
    k5 = conv_check((2, 2, 2), (2, 2, 2))
    assert group_refusals([(4, 4, 4, 4), (4, 1, 4, 4)], (2, 1, 1), k5) == [
        (1, "DistConv3d: a block of 1 voxels along split axis 0 cannot fill a halo of 2 (halos "
            "come from the direct neighbour only)"),
    ]  # fmt: skip
    assert group_refusals([(1, 1, 4, 4, 4), (1, 1, 4, 6, 4)], (2, 1, 1), s2) == [
        (None, "the blocks do not tile a volume: blocks at index 0 along axis 1 differ in "
               "length (4 and 6)"),
    ]  # fmt: skip
    assert group_refusals([(2, 1, 4, 4, 4), (1, 1, 4, 4, 4), (4, 4)], (3, 1, 1), s2) == [
        (1, "leading axes (1, 1) differ from spatial rank 0's (2, 1)"),
        (2, "an input of 2 axes; need (N, C, *spatial) or (C, *spatial)"),
    ]


def test_the_message_names_the_rank_its_reason_and_every_input():
    msg = refusal_message("DistConv3d", [(1, 5), (1, 4)], [(0, "odd")], [6, 7])
    assert msg == (
        "DistConv3d: the spatial group refuses this input geometry; spatial rank 0 (global rank "
        "6): odd (inputs by spatial rank: 0: (1, 5), 1: (1, 4))"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' results; a rank still running after 30 s (half the halo timeout) fails."""
    out = tmp_path_factory.mktemp("agree") / "out"
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    base.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                OMP_NUM_THREADS="1")  # fmt: skip
    port, procs = free_port(), []
    for rank in range(2):
        env = {**base, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        cmd = [sys.executable, str(JOB), str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    wait_ranks(procs, 30)
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]


REFUSED = {
    "conv-k3s2-odd-block": "spatial rank 0 (global rank 0): DistConv3d: block 0 of 2 along "
    "split axis 0 has 5 voxels, not a multiple of the stride 2",
    "conv-k3s2-odd-block-h": "spatial rank 0 (global rank 0): DistConv3d: block 0 of 2 along "
    "split axis 0 has 7 voxels",
    "conv-k5s2-short-block": "spatial rank 1 (global rank 1): DistConv3d: a block of 1 voxels "
    "along split axis 0 cannot fill a halo of 2",
    "conv-k3s2-not-a-box": "the blocks do not tile a volume: blocks at index 0 along axis 1 "
    "differ in length (4 and 6)",
    "conv-k3s2-batch-differs": "spatial rank 1 (global rank 1): leading axes (1, 1) differ "
    "from spatial rank 0's (2, 1)",
    "pool-k2s2-odd-block": "spatial rank 0 (global rank 0): DistMaxPool3d: block 0 of 2 along "
    "split axis 0 has 3 voxels, not a multiple of the stride 2",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_block_one_rank_refuses_raises_the_same_error_on_both(ranks, case):
    r0, r1 = ranks[0][case], ranks[1][case]
    assert r0["error"] == r1["error"]
    assert REFUSED[case] in r0["error"], r0["error"]
    assert r0["error"].startswith(("DistConv3d: the spatial group refuses this input geometry;",
                                   "DistMaxPool3d: the spatial group refuses"))  # fmt: skip
    assert r0["agreed"] == r1["agreed"] == 0  # a refused shape is not remembered


def test_the_full_message_of_one_refusal(ranks):
    assert ranks[1]["conv-k3s2-odd-block"]["error"] == (
        "DistConv3d: the spatial group refuses this input geometry; spatial rank 0 (global rank "
        "0): DistConv3d: block 0 of 2 along split axis 0 has 5 voxels, not a multiple of the "
        "stride 2; every block but the last along a split axis must be, so that every block "
        "starts on the stride (inputs by spatial rank: 0: (1, 1, 5, 4, 4), 1: (1, 1, 4, 4, 4))"
    )


def test_a_valid_geometry_is_agreed_once_per_shape(ranks):
    for rank, outputs in ((0, [1, 1, 2, 2, 2]), (1, [1, 1, 3, 2, 2])):
        r = ranks[rank]
        assert r["valid-3-steps"] == {"error": None, "agreed": 1, "outputs": [outputs] * 3}
        assert r["valid-new-batch"] == {"error": None, "agreed": 2}

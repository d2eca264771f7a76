"""Rank and world size from what launched the process, in order of precedence."""

from __future__ import annotations

import pytest

from datastore.world import detect_world


def test_precedence_given_torchrun_slurm_single():
    assert detect_world(env={}).source == "single process"
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}
    assert (detect_world(env=slurm).rank, detect_world(env=slurm).size) == (3, 8)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", **slurm}
    w = detect_world(env=torchrun)
    assert (w.rank, w.size, w.source) == (1, 2, "torchrun environment")
    w = detect_world(rank=5, world=6, env=torchrun)
    assert (w.rank, w.size, w.source) == (5, 6, "given")


def test_given_must_be_complete_and_in_range():
    with pytest.raises(ValueError, match="give both rank and world"):
        detect_world(rank=1, env={})
    with pytest.raises(ValueError, match="0 <= rank < world"):
        detect_world(rank=2, world=2, env={})

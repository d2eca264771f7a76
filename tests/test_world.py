"""Rank and world size from what launched the process, in order of precedence."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import h5py
import numpy as np
import pytest
from helpers import MPIEXEC

from datastore.order import Schedule
from datastore.world import detect_world

JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "world_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["torch", "given"])
def test_an_mpi_job_exchanges_even_after_torch_init_or_with_rank_given(tmp_path, mode):
    """Traps 5 and 11: the trainer initializes torch.distributed and passes rank/world; under
    mpiexec the loader must still hold the dataset once between the ranks (MPI exchange)."""
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(0).standard_normal((16, 64), dtype=np.float32)
        f["idx"] = np.arange(16, dtype=np.int64)
    out = tmp_path / "seen"
    job = [JOB, str(path), mode, str(free_port()), str(out)]
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", *job]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"seen.{r}.json").read_text()) for r in range(2)]
    assert [r["source"] for r in got] == ["mpi", "mpi"]
    assert [r["keys"] for r in got] == [8, 8] and all(r["exchanged"] > 0 for r in got)
    order = Schedule(16, 4, seed=1).order(0).reshape(4, 4)
    assert [r["ids"] for r in got] == [order[:, :2].tolist(), order[:, 2:].tolist()]

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

from datastore.maths.order import Schedule
from datastore.ranks.world import detect_world
from staging.cluster import (
    LAUNCH_ENV,
    env_world,
    launched_by_mpi,
    local_rank,
    local_size,
    torchrun_world,
)

JOBS = os.path.join(os.path.dirname(__file__), "mpi_jobs")
JOB = os.path.join(JOBS, "world_job.py")
DETECT_JOB = os.path.join(JOBS, "detect_world_job.py")

# what each launcher sets for rank 3 of 8, rank 1 of 4 on its node
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
SRUN = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2,4(x2)",
    "SLURM_NODEID": "1",
    "PMIX_RANK": "3",
}


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


@pytest.mark.parametrize(
    ("env", "mpi", "per_node", "launched"),
    [
        (MPICH, True, 4, None),
        (OPEN_MPI, True, 4, None),
        (TORCHRUN, False, 4, (3, 8, "torchrun environment")),
        (SRUN, True, 4, (3, 8, "Slurm environment")),
    ],
)
def test_each_launcher_and_without_launch_env_a_plain_process(env, mpi, per_node, launched):
    assert launched_by_mpi(env) == mpi and env_world(env) == launched
    assert (local_rank(env), local_size(env)) == (1, per_node)
    plain = {k: v for k, v in env.items() if k not in LAUNCH_ENV}
    assert not launched_by_mpi(plain) and env_world(plain) is None
    assert (local_rank(plain), local_size(plain), torchrun_world(plain)) == (None, 1, None)
    assert detect_world(env=plain).source == "single process"


@pytest.mark.parametrize(
    ("tasks", "node", "here"),
    [
        ("4", "0", 4),
        ("4(x3)", "2", 4),
        ("2,4(x2),3", "3", 3),
        ("2,4(x2)", "5", 1),
        ("x", "0", 1),
        ("8(x1000000000000)", "7", 8),
    ],
)
def test_ranks_per_node_from_slurm(tasks, node, here):
    assert local_size({"SLURM_STEP_TASKS_PER_NODE": tasks, "SLURM_NODEID": node}) == here


def test_torchrun_world():
    assert torchrun_world(TORCHRUN) == (3, 8)
    assert torchrun_world({"RANK": "0"}) is None and torchrun_world({}) is None


@pytest.mark.mpi
def test_detect_world_under_mpiexec_is_mpi_after_torch_init_or_with_rank_given(tmp_path):
    """Traps 5 and 11 at the source: under ``mpiexec``, ``detect_world`` returns MPI's
    communicator after ``init_process_group`` and with ``rank``/``world`` given; rank or size
    disagreements are a ``ValueError`` naming both sides."""
    out = tmp_path / "seen"
    job = [DETECT_JOB, *(str(free_port()) for _ in range(4)), str(out)]
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", *job]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        seen = json.loads((tmp_path / f"seen.{rank}.json").read_text())
        mpi = {"rank": rank, "size": 2, "comm": True}
        assert seen["plain"] == {**mpi, "source": "MPI launcher"}
        assert seen["torch"] == {**mpi, "source": "MPI launcher"}
        assert seen["torch+given"] == {**mpi, "source": "MPI launcher (rank and world given)"}
        assert seen["given"] == {**mpi, "source": "MPI launcher (rank and world given)"}
        assert seen["sub_job"] == {"rank": 0, "size": 1, "source": "given", "comm": False}
        error = seen["given_wrong_rank"]["error"]
        assert f"rank={1 - rank} was given, but this is MPI rank {rank} of 2" in error
        error = seen["torch_swapped"]["error"]
        assert f"torch.distributed says rank {1 - rank} of 2, MPI says rank {rank} of 2" in error
        error = seen["torch_other_size"]["error"]
        assert f"torch.distributed says rank 0 of 1, MPI says rank {rank} of 2" in error


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

"""Where this process stands in the job: ranks, nodes, and the node's I/O leader.

This is the one module that reads launchers' variables (MPI's PMI, Open MPI's, torchrun's,
Slurm's); ``datastore.ranks.world`` builds the loader's view of the world on it.

Without an MPI launcher nothing imports MPI and a single-process ``SoloComm`` stands in, so one
rank needs no MPI at all. Under ``mpiexec``/``srun`` the nodes are found with an MPI
shared-memory split (``COMM_TYPE_SHARED``); ``ranks_per_node`` overrides that (tests, or
launchers whose shared-memory split misreports).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LAUNCH_ENV",
    "Layout",
    "SoloComm",
    "env_world",
    "launched_by_mpi",
    "layout",
    "local_rank",
    "local_size",
    "torchrun_world",
    "world",
]

_LAUNCHER_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "MPI_LOCALRANKID")
_LOCAL_SIZE = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
_LOCAL_RANK = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
# every variable of a launcher this module reads: drop them to start a child as a plain process
LAUNCH_ENV = (
    *_LAUNCHER_VARS,
    *("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_TASKS_PER_NODE", "RANK", "WORLD_SIZE"),
    *_LOCAL_SIZE,
    *_LOCAL_RANK,
)


def launched_by_mpi(env: Mapping[str, str] | None = None) -> bool:
    """True when an MPI launcher (mpiexec, srun with PMI/PMIx) started this process."""
    env = os.environ if env is None else env
    if any(v in env for v in _LAUNCHER_VARS):
        return True
    return int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in env


def torchrun_world(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(rank, size)`` from torchrun's ``RANK`` / ``WORLD_SIZE``, else ``None``."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    return None


def env_world(env: Mapping[str, str] | None = None) -> tuple[int, int, str] | None:
    """``(rank, size, source)`` from torchrun's or Slurm's variables, else ``None``."""
    env = os.environ if env is None else env
    torchrun = torchrun_world(env)
    if torchrun is not None:
        return (*torchrun, "torchrun environment")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), "Slurm environment"
    return None


def _first_int(names: tuple[str, ...], env: Mapping[str, str] | None) -> int | None:
    env = os.environ if env is None else env
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def local_size(env: Mapping[str, str] | None = None) -> int:
    """Ranks on this node, as the launcher says (torchrun, MPICH, Open MPI, Slurm); 1 if
    unknown."""
    env = os.environ if env is None else env
    return max(1, _first_int(_LOCAL_SIZE, env) or _slurm_tasks_here(env) or 1)


def _slurm_tasks_here(env: Mapping[str, str]) -> int | None:
    """This node's entry of Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``"4(x2),3"``: 4 tasks on
    each of nodes 0 and 1, 3 on node 2), by ``SLURM_NODEID``; ``None`` if either is missing."""
    spec, node = env.get("SLURM_STEP_TASKS_PER_NODE", ""), env.get("SLURM_NODEID", "")
    if not spec or not node.isdigit():
        return None
    left = int(node)  # nodes still to skip
    for part in spec.split(","):
        tasks, _, times = part.partition("(x")
        repeat = times[:-1] if times.endswith(")") else ("1" if not times else "")
        if not (tasks.isdigit() and repeat.isdigit()):
            return None
        if left < int(repeat):
            return int(tasks)
        left -= int(repeat)
    return None


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This rank's index on its node, as the launcher says; ``None`` if unknown."""
    return _first_int(_LOCAL_RANK, env)


class SoloComm:
    """The subset of an mpi4py communicator used here, for a job of one process."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def gather(self, obj: Any, root: int = 0) -> list[Any]:
        return [obj]

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def allreduce(self, obj: Any, op: Any = None) -> Any:
        return obj

    def Barrier(self) -> None:
        return None

    def Abort(self, code: int = 1) -> None:
        os._exit(code)


def world() -> Any:
    """``MPI.COMM_WORLD`` under an MPI launcher, else a ``SoloComm``.

    Raises:
        LaunchMismatch: the launcher started several ranks, this process sees a world of 1.
    """
    if not launched_by_mpi():
        return SoloComm()
    from staging.launcher import comm_world

    return comm_world()


@dataclass(frozen=True)
class Layout:
    """This rank's place: ``node`` of ``nodes``, ``local_rank`` of ``local_size`` on it."""

    rank: int
    size: int
    node: int
    nodes: int
    local_rank: int
    local_size: int

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0


def layout(comm: Any, ranks_per_node: int | None = None) -> tuple[Layout, Any]:
    """This rank's ``Layout`` and the communicator of the ranks on its node."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return Layout(0, 1, 0, 1, 0, 1), comm
    from mpi4py import MPI

    if ranks_per_node:
        node_comm = comm.Split(rank // ranks_per_node, rank)
    else:
        node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, rank)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    leaders = comm.allgather(rank if local_rank == 0 else None)
    leaders = [r for r in leaders if r is not None]
    node = node_comm.bcast(leaders.index(rank) if local_rank == 0 else None, root=0)
    return Layout(rank, size, node, len(leaders), local_rank, local_size), node_comm

"""Who am I: rank and world size from what launched us, in a fixed order of precedence.

1. given explicitly (``rank=``, ``world=``);
2. an initialized ``torch.distributed`` process group;
3. an MPI launcher (``mpiexec``, ``srun`` with PMI): ``MPI.COMM_WORLD``;
4. torchrun's ``RANK`` / ``WORLD_SIZE``;
5. Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS``;
6. otherwise a single process.

The source is kept (``World.source``) and printed by the loader, so a surprise is visible.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from staging.cluster import launched_by_mpi

__all__ = ["World", "detect_world"]


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    source: str
    comm: Any = None  # an mpi4py communicator when MPI launched us


def detect_world(
    rank: int | None = None,
    world: int | None = None,
    comm: Any = None,
    env: dict[str, str] | None = None,
) -> World:
    """This process's rank and world size; ``comm`` (mpi4py) wins over everything else."""
    env = os.environ if env is None else env
    if comm is not None:
        return World(comm.Get_rank(), comm.Get_size(), "the given MPI communicator", comm)
    if rank is not None or world is not None:
        if rank is None or world is None or not 0 <= rank < world:
            raise ValueError(
                f"give both rank and world, with 0 <= rank < world (got {rank}, {world})"
            )
        return World(rank, world, "given")
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return World(dist.get_rank(), dist.get_world_size(), "torch.distributed")
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if launched_by_mpi(env):
        from mpi4py import MPI

        c = MPI.COMM_WORLD
        return World(c.Get_rank(), c.Get_size(), "MPI launcher", c)
    if "RANK" in env and "WORLD_SIZE" in env:
        return World(int(env["RANK"]), int(env["WORLD_SIZE"]), "torchrun environment")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return World(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), "Slurm environment")
    return World(0, 1, "single process")

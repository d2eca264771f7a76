"""Who am I: rank and world size from what launched us, in a fixed order of precedence.

1. an mpi4py communicator given explicitly (``comm=``);
2. an MPI launcher (``mpiexec``, ``srun`` with PMI): ``MPI.COMM_WORLD``, so the exchange runs over
   MPI, also when
   - ``torch.distributed`` is initialized (trap 5): its group must number the ranks as MPI does
     (same size, same rank), else ``ValueError`` naming both;
   - ``rank`` and ``world`` are given with ``world`` = ``COMM_WORLD``'s size (trap 11; how the
     trainer calls it): ``rank`` must be the MPI rank, else ``ValueError`` naming both;
   ``rank``/``world`` with another ``world`` are a job of its own inside the MPI job: taken as
   given, with no communicator (nothing is exchanged);
3. given explicitly (``rank=``, ``world=``);
4. an initialized ``torch.distributed`` process group: ``group``'s numbering when one is given
   (``ExchangeOptions(group=...)``, a data-parallel group), else the default group's;
5. torchrun's ``RANK`` / ``WORLD_SIZE``;
6. Slurm's ``SLURM_PROCID`` / ``SLURM_NTASKS``;
7. otherwise a single process.

The launchers' variables are read by ``staging.cluster`` (the one module that does).
The source is kept (``World.source``) and printed by the loader, so a surprise is visible.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any

from staging.cluster import env_world, launched_by_mpi

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
    group: Any = None,
) -> World:
    """This process's rank and world size; ``comm`` (mpi4py) wins over everything else;
    ``group``: the ``torch.distributed`` group the exchange spans (default: every rank)."""
    env = os.environ if env is None else env
    if comm is not None:
        return World(comm.Get_rank(), comm.Get_size(), "the given MPI communicator", comm)
    given = rank is not None or world is not None
    for name, v in (("rank", rank), ("world", world)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise ValueError(f"{name} must be an int, got {v!r}")
    rank, world = (None if v is None else int(v) for v in (rank, world))
    if given and (rank is None or world is None or not 0 <= rank < world):
        raise ValueError(f"give both rank and world, with 0 <= rank < world (got {rank}, {world})")
    if launched_by_mpi(env):
        return _mpi_world(rank, world)
    if rank is not None:
        return World(rank, world, "given")  # type: ignore[arg-type]
    dist = _torch_dist()
    if dist is not None and group is not None:
        me = dist.get_rank(group)
        if me < 0:
            raise ValueError(
                f"ExchangeOptions.group does not hold this rank (rank {dist.get_rank()} of the "
                "default group): each rank passes the group it belongs to"
            )
        return World(me, dist.get_world_size(group), "the given torch.distributed group")
    if dist is not None:
        return World(dist.get_rank(), dist.get_world_size(), "torch.distributed")
    launched = env_world(env)
    if launched is not None:
        return World(*launched)
    return World(0, 1, "single process")


def _torch_dist() -> Any:
    """``torch.distributed`` when its default group is initialized, else ``None``."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _mpi_world(rank: int | None, world: int | None) -> World:
    """``COMM_WORLD``, checked against what the caller or ``torch.distributed`` says."""
    from staging.launcher import comm_world

    c = comm_world()  # LaunchMismatch: N ranks launched, each alone in its MPI world
    me, size = c.Get_rank(), c.Get_size()
    if world is not None:
        if world != size:  # a sub-job of its own: trust the caller, exchange nothing
            return World(rank, world, "given")  # type: ignore[arg-type]
        if rank != me:
            raise ValueError(
                f"rank={rank} was given, but this is MPI rank {me} of {size}: under an MPI "
                "launcher the ranks must be numbered as MPI numbers them"
            )
        return World(me, size, "MPI launcher (rank and world given)", c)
    dist = _torch_dist()
    if dist is not None and (dist.get_world_size(), dist.get_rank()) != (size, me):
        raise ValueError(
            f"torch.distributed says rank {dist.get_rank()} of {dist.get_world_size()}, MPI "
            f"says rank {me} of {size}: initialize the process group with MPI's rank and size"
        )
    return World(me, size, "MPI launcher", c)

"""The process grid of a hybrid data x spatial parallel job, and how to start one.

Layout
    A job of ``W`` ranks runs ``D`` data-parallel replicas of a model whose every sample is split
    into ``S = prod(parts)`` spatial blocks (``parts`` e.g. ``(2, 1, 1)`` depth slabs, ``(2, 2, 1)``
    a 2-D or ``(2, 2, 2)`` a 3-D decomposition), ``W = D * S``. Ranks are numbered
    spatial-fastest, as the loader numbers them (``datastore.maths.order.rank_layout``)::

        rank = data_rank * S + spatial_rank

    so the ``S`` ranks of one sample are consecutive (usually on one node).

Numbering inside the spatial group
    Spatial rank ``s`` holds block ``s`` of ``datastore.maths.partition``: block coordinates in C
    order over ``parts``, last axis fastest (``block_coords``). For ``parts=(2, 2, 1)`` spatial
    rank 1 has coordinates ``(0, 1, 0)`` and spatial rank 2 ``(1, 0, 0)``.

Groups
    Every rank belongs to one *spatial group* (the ``S`` ranks of its sample: halo exchange,
    sums of weight gradients over blocks) and one *data group* (the ``D`` ranks holding the same
    block of different samples: gradient averaging across replicas). ``torch.distributed``
    requires every rank to call ``new_group`` for every group, in the same order:
    :meth:`ProcessGrid.create` creates all spatial groups (by data rank), then all data groups
    (by spatial rank). Inside a group, peers are addressed by their *group* rank; the spatial
    rank of a block equals its rank in the spatial group, and ``neighbours`` are spatial ranks.

Starting
    :func:`init_distributed` starts the default process group (gloo, or NCCL bound to the
    rank's GPU; ``trainer.devices`` chooses) with a timeout, taking
    rank and size from an MPI launcher (``mpiexec``/``srun``: rank 0 picks a free port and
    broadcasts it over MPI) or from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), or as a single process. Launch MPI jobs with
    ``python -m mpi4py`` so that an exception in one rank aborts all of them.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from datastore.errors import ExchangeTimeout
from datastore.maths.order import rank_layout
from datastore.maths.partition import Grid, block_coords, block_index
from staging.cluster import launched_by_mpi, torchrun_world
from staging.launcher import comm_world

__all__ = [
    "DEFAULT_TIMEOUT",
    "ProcessGrid",
    "group_members",
    "init_distributed",
    "neighbours_of",
    "spatial_coords_of",
]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)
"""How long a collective or a receive may wait before the process group gives up."""

_started_with: dict[str, datetime.timedelta] = {}  # the timeout init_distributed used


def _block_grid(parts: Sequence[int]) -> Grid:
    # The partition module numbers blocks from a Grid; a volume of shape == parts (one voxel
    # per block) has exactly the block grid we need, so the numbering is the loader's own.
    return Grid(shape=tuple(parts), parts=tuple(parts))


def spatial_coords_of(parts: Sequence[int], spatial_rank: int) -> tuple[int, ...]:
    """Block coordinates of ``spatial_rank`` (C order over ``parts``, last axis fastest)."""
    return block_coords(_block_grid(parts), spatial_rank)


def neighbours_of(
    parts: Sequence[int], spatial_rank: int
) -> tuple[tuple[int | None, int | None], ...]:
    """``(low, high)`` neighbour spatial ranks of ``spatial_rank`` along every axis.

    ``None`` where the block touches the global boundary (no periodic wrap).
    """
    grid = _block_grid(parts)
    coords = block_coords(grid, spatial_rank)
    out = []
    for axis, p in enumerate(grid.parts):
        pair: list[int | None] = []
        for step in (-1, 1):
            c = coords[axis] + step
            if 0 <= c < p:
                pair.append(block_index(grid, (*coords[:axis], c, *coords[axis + 1 :])))
            else:
                pair.append(None)
        out.append((pair[0], pair[1]))
    return tuple(out)


def group_members(world: int, spatial_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of every spatial group (by data rank) and every data group (by spatial rank).

    Spatial group ``d`` is ``[d*S, ..., d*S + S - 1]``; data group ``s`` is ``[s, S + s, ...]``.
    Group ranks follow the order of the lists (``new_group`` sorts ranks; these are sorted).
    """
    rank_layout(0, world, spatial_size)  # validates world % spatial_size
    data_size = world // spatial_size
    spatial = [[d * spatial_size + s for s in range(spatial_size)] for d in range(data_size)]
    data = [[d * spatial_size + s for d in range(data_size)] for s in range(spatial_size)]
    return spatial, data


@dataclass(frozen=True, eq=False)
class ProcessGrid:
    """This rank's place in a ``data_size`` x ``parts`` grid, with its process groups.

    Build it with :meth:`create` (collective over the default group).

    Attributes:
        rank: global rank.
        world: global size, ``data_size * spatial_size``.
        parts: spatial blocks per axis, e.g. ``(2, 1, 1)``.
        data_rank: which replica (sample) this rank works on, ``rank // spatial_size``.
        data_size: number of replicas.
        spatial_rank: block number, ``rank % spatial_size``; also the rank in ``spatial_group``.
        spatial_coords: block coordinates (C order over ``parts``).
        neighbours: ``(low, high)`` neighbour spatial ranks per axis, ``None`` at the boundary.
        spatial_group: process group of the ``spatial_size`` blocks of this sample.
        data_group: process group of the ``data_size`` ranks holding this block; the rank in it
            is ``data_rank``.
        timeout: how long a halo receive waits (gloo applies its group timeout to collectives
            but not to point-to-point waits, so the halo code passes this one explicitly).
    """

    rank: int
    world: int
    parts: tuple[int, ...]
    data_rank: int
    data_size: int
    spatial_rank: int
    spatial_coords: tuple[int, ...]
    neighbours: tuple[tuple[int | None, int | None], ...]
    spatial_group: Any = None
    data_group: Any = None
    timeout: datetime.timedelta = DEFAULT_TIMEOUT

    @property
    def spatial_size(self) -> int:
        return math.prod(self.parts)

    @property
    def ndim(self) -> int:
        return len(self.parts)

    @classmethod
    def create(
        cls, parts: Sequence[int], *, timeout: datetime.timedelta | None = None
    ) -> ProcessGrid:
        """Place this rank and create every spatial and data group (call on every rank).

        Args:
            parts: spatial blocks per axis; ``prod(parts)`` must divide the world size, the
                rest is the data-parallel size.
            timeout: for the new groups and halo receives. Default: ``None``, the one given to
                :func:`init_distributed` (else 120 s).

        Raises:
            ValueError: on a bad ``parts`` or a world size that ``prod(parts)`` does not divide.
            RuntimeError: if ``torch.distributed`` is not initialized.
        """
        parts = tuple(int(p) for p in parts)
        if not parts or any(p < 1 for p in parts):
            raise ValueError(f"parts must be >= 1 blocks per axis, got {parts}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (call init_distributed())")
        rank, world = dist.get_rank(), dist.get_world_size()
        layout = rank_layout(rank, world, math.prod(parts))
        spatial_lists, data_lists = group_members(world, layout.spatial_size)
        spatial_group = data_group = None
        # Same groups, same order, on every rank.
        for d, members in enumerate(spatial_lists):
            g = dist.new_group(members, timeout=timeout)
            if d == layout.data_rank:
                spatial_group = g
        for s, members in enumerate(data_lists):
            g = dist.new_group(members, timeout=timeout)
            if s == layout.spatial_rank:
                data_group = g
        return cls(
            rank=rank,
            world=world,
            parts=parts,
            data_rank=layout.data_rank,
            data_size=layout.data_world,
            spatial_rank=layout.spatial_rank,
            spatial_coords=spatial_coords_of(parts, layout.spatial_rank),
            neighbours=neighbours_of(parts, layout.spatial_rank),
            spatial_group=spatial_group,
            data_group=data_group,
            timeout=timeout or _started_with.get("timeout", DEFAULT_TIMEOUT),
        )

    def spatial_peer(self, spatial_rank: int) -> int:
        """Global rank of spatial rank ``spatial_rank`` of this sample."""
        return dist.get_global_rank(self.spatial_group, spatial_rank)


def _free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_distributed(
    backend: str = "gloo",
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    device: torch.device | None = None,
) -> tuple[int, int]:
    """Start the default process group; returns ``(rank, world)``.

    Where rank and size come from, in order: an already initialized group (returned as is); an
    MPI launcher (``mpi4py``; the address is ``MASTER_ADDR`` if set, else ``127.0.0.1`` when all
    ranks share one host, else rank 0's host name; rank 0 picks a free port and broadcasts it);
    torchrun's ``RANK``/``WORLD_SIZE`` (with its ``MASTER_ADDR``/``MASTER_PORT``); otherwise a
    single process on a free local port.

    Args:
        backend: ``"gloo"`` (CPU, or GPUs shared through host memory) or ``"nccl"``.
            Default: ``"gloo"``.
        timeout: for the rendezvous (past it, :class:`~datastore.errors.ExchangeTimeout`: a
            rank did not join) and every collective and receive of the group (NCCL's watchdog
            ends a collective after it). Default: 120 s.
        env: environment to read. Default: ``os.environ``.
        device: this rank's GPU, for NCCL: made the current device and bound to the group.
            Default: ``None``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = os.environ if env is None else env
    torchrun = torchrun_world(env)
    if launched_by_mpi(env):
        comm = comm_world(env)  # LaunchMismatch: N ranks launched, each alone in its world
        rank, world = comm.Get_rank(), comm.Get_size()
        hosts = comm.allgather(socket.gethostname())
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif len(set(hosts)) == 1:
            addr = "127.0.0.1"
        else:
            addr = hosts[0]
        port = comm.bcast(_free_port() if rank == 0 else None, root=0)
        # every rank has the port before rank 0 leaves MPI for the rendezvous: an MPI that
        # moves messages only inside MPI calls (the mpich wheel's OFI netmod without auto
        # progress) would otherwise hold the port until the rendezvous timed out
        comm.Barrier()
        init_method = f"tcp://{addr}:{port}"
    elif torchrun is not None:
        rank, world = torchrun
        init_method = "env://"
        addr = env.get("MASTER_ADDR", "")
    else:
        rank, world, addr = 0, 1, "127.0.0.1"
        init_method = f"tcp://{addr}:{_free_port(addr)}"
    if backend == "gloo" and addr in ("127.0.0.1", "localhost"):
        # Gloo binds to the interface of the host name, which in containers may not route to
        # itself; on one host the loopback interface always does.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    bound: dict[str, Any] = {}
    if backend == "nccl" and device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        bound["device_id"] = device
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout, **bound
        )
    except dist.DistStoreError as exc:  # a rank never joined: it did not start, or died
        raise ExchangeTimeout(
            f"the process group of {world} ranks did not form within comm_timeout "
            f"({timeout.total_seconds():g} s) at {init_method}: a rank did not start, or died "
            f"({' '.join(str(exc).split())})",
            -1,
            (),
        ) from None
    _started_with["timeout"] = timeout
    return rank, world

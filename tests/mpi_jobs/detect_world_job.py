"""Run under ``mpiexec -n 2 python -m mpi4py``: what ``detect_world`` says under an MPI launcher
in each way a training script may have set things up first (traps 5 and 11). Each rank writes
``{case: {"rank", "size", "source", "comm", "error"}}`` to OUT.RANK.json.

Cases, in order (each ``torch.distributed`` group is destroyed before the next case):

- ``plain``: nothing set up;
- ``torch``: ``init_process_group`` (gloo) with MPI's rank and size first;
- ``torch+given``: the same, and ``rank``/``world`` passed too;
- ``given``: ``rank``/``world`` passed, as MPI numbers the ranks;
- ``given_wrong_rank``: ``rank`` passed as the other rank's;
- ``sub_job``: ``rank=0, world=1`` (a job of its own inside the MPI job);
- ``torch_swapped``: a torch group whose ranks are MPI's swapped;
- ``torch_other_size``: a torch group of one process on each rank.

Usage: detect_world_job.py PORT_A PORT_B PORT_C PORT_D OUT
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from job_rows import write_row
from mpi4py import MPI

from datastore.ranks.world import detect_world


def torch_group(rank: int, size: int, port: str) -> None:
    """A gloo default group at 127.0.0.1:``port`` (``MASTER_ADDR``/``MASTER_PORT``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size)


def outcome(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        w = call()
    except ValueError as exc:
        return {"error": str(exc)}
    return {"rank": w.rank, "size": w.size, "source": w.source, "comm": w.comm is not None}


def main() -> None:
    port_a, port_b, port_c, port_d, out_prefix = sys.argv[1:6]
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    seen: dict[str, Any] = {"plain": outcome(detect_world)}

    torch_group(rank, size, port_a)
    seen["torch"] = outcome(detect_world)
    seen["torch+given"] = outcome(lambda: detect_world(rank=rank, world=size))
    dist.destroy_process_group()

    seen["given"] = outcome(lambda: detect_world(rank=rank, world=size))
    seen["given_wrong_rank"] = outcome(lambda: detect_world(rank=size - 1 - rank, world=size))
    seen["sub_job"] = outcome(lambda: detect_world(rank=0, world=1))

    torch_group(size - 1 - rank, size, port_b)
    seen["torch_swapped"] = outcome(detect_world)
    dist.destroy_process_group()

    comm.Barrier()  # both groups above are gone before the one-process groups start
    torch_group(0, 1, port_c if rank == 0 else port_d)
    seen["torch_other_size"] = outcome(detect_world)
    dist.destroy_process_group()

    write_row(out_prefix, rank, seen)


if __name__ == "__main__":
    main()

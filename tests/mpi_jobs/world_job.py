"""Run under ``mpiexec -n 2 python -m mpi4py``: a loader built the way the trainer builds it
(MODE ``torch``: after ``init_process_group``; ``given``: with ``rank``/``world``) must still
exchange over MPI. Each rank writes what it saw to OUT.RANK.json.

Usage: world_job.py DATASET MODE PORT OUT
"""

from __future__ import annotations

import sys

import torch.distributed as dist
from job_rows import write_row
from mpi4py import MPI

from datastore import DataStoreLoader


def main() -> None:
    path, mode, port, out_prefix = sys.argv[1:5]
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    kw = {}
    if mode == "torch":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
    else:
        kw = {"rank": rank, "world": size}
    loader = DataStoreLoader(path, global_batch_size=4, seed=1, **kw)
    ids = [b["idx"].tolist() for b in loader]
    out = {
        "rank": rank,
        "source": loader.source,
        "keys": len(loader.store.keys),
        "exchanged": loader.counters.bytes_exchanged,
        "ids": ids,
    }
    write_row(out_prefix, rank, out)
    loader.close()
    if mode == "torch":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

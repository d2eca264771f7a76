"""Under ``mpiexec -n N python -m mpi4py``: rank r reads ``ROOT/node{r}/src`` (its node's share
from ``datastore stage --mode shard --ranks-per-node 1``) and rank 0 writes, as JSON, the
sample identities (x[0,0,0,0]) of every global batch and the samples each rank stored.

Usage: shard_job.py ROOT SRC OUT_JSON GLOBAL_BATCH
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from mpi4py import MPI

from datastore import DataStoreLoader


def main() -> None:
    root, src, out, gb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    loader = DataStoreLoader(os.path.join(root, f"node{rank}", "src"), global_batch_size=gb, seed=5)
    names = sorted(os.listdir(src))
    seen = []
    for batch in loader:
        ids = [int(v) for v in batch["data"][:, 0, 0, 0, 0].tolist()]
        for j, i in enumerate(ids):
            want = np.load(os.path.join(src, names[i]))
            if not np.array_equal(batch["data"][j].numpy(), want):
                raise SystemExit(f"rank {rank}: wrong data for sample {i}")
        seen.append(ids)
    stored = [int(k) for k in loader.store.keys]
    everything = comm.gather((seen, stored), root=0)
    if rank == 0:
        steps = [[i for s, _ in everything for i in s[k]] for k in range(len(seen))]
        with open(out, "w") as f:
            json.dump({"steps": steps, "stored": [st for _, st in everything]}, f)
    loader.close()


if __name__ == "__main__":
    main()

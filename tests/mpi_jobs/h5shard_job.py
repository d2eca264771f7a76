"""Under ``mpiexec -n N python -m mpi4py``: rank r reads ``ROOT/node{r}/src`` (its node's shard
files from ``datastore stage --mode shard --ranks-per-node 1``), checks every sample's bytes
against the whole set in SRC, and rank 0 writes, as JSON, the ``idx`` of every global batch and
the samples each rank stored.

Usage: h5shard_job.py ROOT SRC OUT_JSON GLOBAL_BATCH
"""

from __future__ import annotations

import json
import os
import sys

from mpi4py import MPI

from datastore import DataStoreLoader
from datastore.readers import open_dataset


def main() -> None:
    root, src, out, gb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    loader = DataStoreLoader(os.path.join(root, f"node{rank}", "src"), global_batch_size=gb, seed=5)
    seen = []
    with open_dataset(src) as whole:
        for batch in loader:
            ids = [int(i) for i in batch["idx"].tolist()]
            for j, i in enumerate(ids):
                for name in ("x", "y"):
                    if batch[name][j].numpy().tobytes() != whole.read(i, name).tobytes():
                        raise SystemExit(f"rank {rank}: wrong {name} for sample {i}")
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

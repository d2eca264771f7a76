"""Under ``mpiexec -n N python -m mpi4py``: rank r reads ``ROOT/node{r}/src`` (its node's share
from ``datastore stage --mode shard --ranks-per-node 1``) and rank 0 writes, as JSON, the
sample identities (x[0,0,0,0]) of every global batch, the samples each rank stored and the
bytes it exchanged, for each shuffle of SHUFFLES (comma-separated; default: global).

Usage: shard_job.py ROOT SRC OUT_JSON GLOBAL_BATCH [SHUFFLES]
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
    shuffles = (sys.argv[5] if len(sys.argv) > 5 else "global").split(",")
    result = {s: run(root, src, gb, s) for s in shuffles}
    if MPI.COMM_WORLD.Get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def run(root: str, src: str, gb: int, shuffle: str) -> dict | None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    share = os.path.join(root, f"node{rank}", "src")
    loader = DataStoreLoader(share, global_batch_size=gb, seed=5, shuffle=shuffle)
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
    sent = int(loader.counters.bytes_exchanged)
    loader.close()
    everything = comm.gather((seen, stored, sent), root=0)
    if rank != 0:
        return None
    return {
        "steps": [[i for s, _, _ in everything for i in s[k]] for k in range(len(seen))],
        "stored": [st for _, st, _ in everything],
        "sent": [b for _, _, b in everything],
    }


if __name__ == "__main__":
    main()

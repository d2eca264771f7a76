"""One MPI job of ``benchmarks/shuffle.py``: the embedded exchange under each shuffle.

Run as ``mpiexec -n R python -m mpi4py benchmarks/shuffle_job.py DATASET --shuffles global,shard``.
For each shuffle every rank builds ``DataStoreLoader(DATASET, batch_size=--batch,
shuffle=...)`` (preloaded: it owns 1/R of the samples), iterates ``--epochs`` epochs and
records, per epoch, the wall time and the bytes it sent to other ranks, and the ``label`` of
every sample it received. Rank 0 prints one line ``SHUFFLE_JSON {...}``.
"""

from __future__ import annotations

import argparse
import json
import time

from mpi4py import MPI

from datastore import DataStoreLoader

MARK = "SHUFFLE_JSON "


def run(dataset: str, shuffle: str, batch: int, epochs: int) -> dict:
    comm = MPI.COMM_WORLD
    loader = DataStoreLoader(dataset, batch_size=batch, seed=1, shuffle=shuffle)
    comm.Barrier()
    seconds, sent, labels = [], [], []
    for _ in range(epochs):
        t0, b0 = time.perf_counter(), loader.counters.bytes_exchanged
        seen = [batch["label"].tolist() for batch in loader]
        seconds.append(time.perf_counter() - t0)
        sent.append(int(loader.counters.bytes_exchanged - b0))
        labels.append(seen)
    loader.close()
    every = comm.gather({"seconds": seconds, "sent": sent, "labels": labels}, root=0)
    return {"ranks": every} if every is not None else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset")
    p.add_argument("--shuffles", default="global,shard,window:64,none")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    out = {s: run(args.dataset, s, args.batch, args.epochs) for s in args.shuffles.split(",")}
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

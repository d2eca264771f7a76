"""One MPI job of ``benchmarks/loader.py`` (case 3): how much of a training step the exchange costs.

Run as ``mpiexec -n R python -m mpi4py benchmarks/exchange_job.py DATASET [options]``. Every
rank builds ``DataStoreLoader(DATASET, global_batch_size=BATCH * data_ranks, seed=0)`` (under
MPI it owns 1/R of the samples, preloaded, and receives the rest of each batch from their
owners), waits for every rank, then iterates ``--epochs`` epochs with a simulated compute step
per batch that burns CPU as a model would (``common.Compute``: a matrix-product loop that took
``--compute-ms`` on rank 0 alone, calibrated before the loader starts while the other ranks
wait without spinning; every rank then runs the same number of products, which take longer
when the loader's threads compete for the cores). Each rank reports the wall time of the
iteration, the seconds its compute took and the loader's counters (``exchange_seconds``,
``wait_seconds``, ``bytes_exchanged``); rank 0 prints them as one line ``EXCHANGE_JSON {...}``
for the parent to parse.

With ``--bare``, the ranks then replay the same bytes as **bare mpi4py**: per step, every rank
sends each other rank its share of the bytes it sent per step (``Isend``/``Irecv`` of one
contiguous buffer, taken in turn from ``BARE_POOL`` bytes of reused buffers so the bytes do not
come from a cache), and report ``exchange_gb_per_s`` (the loader's: bytes sent / exchange
seconds, which also count its local copies) beside ``bare_gb_per_s`` (bytes sent / seconds of
the replay). Run it with ``--compute-ms 0`` to compare the two exchanges alone::

    mpiexec -n 2 python -m mpi4py benchmarks/exchange_job.py DATA.h5 --compute-ms 0 --bare
    mpiexec -n 2 python -m mpi4py benchmarks/exchange_job.py DATA.h5 --compute-ms 0 --bare \
        --parts 2,1,1 --halo 1,1,1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
from common import Compute
from mpi4py import MPI

from datastore import DataStoreLoader
from datastore.readers.spec import DatasetSpec, FieldSpec

MARK = "EXCHANGE_JSON "
BARE_POOL = 256 << 20  # bytes of buffers the bare replay cycles through, each way


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", help="an HDF5 file or a directory of per-sample .npy files")
    p.add_argument("--batch", type=int, default=8, help="samples per step per data rank")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--compute-ms", type=float, default=50.0, help="simulated compute per batch")
    p.add_argument("--parts", default="", help="spatial blocks, e.g. 2,1,1 (default: none)")
    p.add_argument("--halo", default="0,0,0", help="halo per spatial axis with --parts")
    p.add_argument("--bare", action="store_true", help="replay the bytes as bare mpi4py too")
    return p.parse_args(argv)


def dataset_arg(path: str) -> str | DatasetSpec:
    """A directory of ``.npy`` files holds field ``x`` (C, D, H, W); anything else auto-detects."""
    if os.path.isdir(path) and any(n.endswith(".npy") for n in os.listdir(path)):
        return DatasetSpec("npy", (path,), (FieldSpec("x", (1, 2, 3)),))
    return path


def calibrated(comm: MPI.Comm, ms: float) -> Compute:
    """``Compute`` of ``ms`` calibrated on rank 0 alone, its products counted on every rank.
    The other ranks wait in a polled barrier (an MPI blocking wait would spin on the cores
    being measured); sleeping there only waits."""
    iters = Compute(ms).iters if comm.Get_rank() == 0 else None
    done = comm.Ibarrier()
    while not done.Test():
        time.sleep(0.005)
    return Compute(ms, iters=comm.bcast(iters, root=0))


def deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: after[k] - before[k] for k in ("exchange_seconds", "wait_seconds", "bytes_exchanged")
    }


def bare_seconds(comm: MPI.Comm, steps: int, nbytes: int) -> float:
    """Seconds of ``steps`` steps in which every rank sends each other rank ``nbytes`` of
    contiguous bytes and receives as many, from and into reused buffers."""
    peers = [r for r in range(comm.Get_size()) if r != comm.Get_rank()]
    k = max(1, min(steps, BARE_POOL // max(1, nbytes * len(peers))))
    sends = [[np.ones(nbytes, np.uint8) for _ in peers] for _ in range(k)]
    recvs = [[np.ones(nbytes, np.uint8) for _ in peers] for _ in range(k)]  # pages touched

    def run(n: int) -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        for s in range(n):
            reqs = [comm.Irecv(b, source=p) for b, p in zip(recvs[s % k], peers, strict=True)]
            reqs += [comm.Isend(b, dest=p) for b, p in zip(sends[s % k], peers, strict=True)]
            MPI.Request.Waitall(reqs)
        return time.perf_counter() - t0

    run(k)  # a warm-up round over every buffer, as the loader's first epoch is
    return run(steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    spatial = None
    blocks = 1
    if args.parts:
        parts = tuple(int(v) for v in args.parts.split(","))
        halo = tuple(int(v) for v in args.halo.split(","))
        spatial = {"parts": parts, "halo": halo, "boundary": "zero"}
        blocks = math.prod(parts)
    data_ranks = size // blocks
    t0 = time.perf_counter()
    loader = DataStoreLoader(
        dataset_arg(args.dataset),
        global_batch_size=args.batch * data_ranks,
        seed=0,
        spatial=spatial,
    )
    construct = time.perf_counter() - t0
    compute = calibrated(comm, args.compute_ms)
    before = loader.counters.as_dict()
    comm.Barrier()
    steps = 0
    check = 0.0
    computed = 0.0
    epochs = []  # per epoch: steps, seconds and counter deltas
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        e0, c0, s0 = time.perf_counter(), loader.counters.as_dict(), steps
        for batch in loader:
            check += float(batch["x"][0, 0, 0, 0, 0])  # touch the batch: data was delivered
            computed += compute()
            steps += 1
        c1 = loader.counters.as_dict()
        epochs.append({"steps": steps - s0, "total_s": time.perf_counter() - e0, **deltas(c0, c1)})
    total = time.perf_counter() - t0
    after = loader.counters.as_dict()
    delta = deltas(before, after)
    batch_bytes = sum(
        int(np.prod((loader.batch_size, *f.shape))) * f.dtype.itemsize for f in loader.fields
    )
    mine = {
        "rank": rank,
        "steps": steps,
        "total_s": total,
        "construct_s": construct,
        "compute_s": computed,
        "compute_iters": compute.iters,
        "batch_bytes": batch_bytes,
        "bytes_resident": after["bytes_resident"],
        "exchanging": loader.source == "mpi",
        "epochs": epochs,
        **delta,
    }
    if delta["exchange_seconds"] > 0:
        mine["exchange_gb_per_s"] = delta["bytes_exchanged"] / delta["exchange_seconds"] / 1e9
    if args.bare and size > 1:
        per_peer = int(comm.allreduce(delta["bytes_exchanged"], op=MPI.MAX)) // steps // (size - 1)
        sent = per_peer * (size - 1) * steps
        mine["bare_gb_per_s"] = sent / bare_seconds(comm, steps, per_peer) / 1e9
    everyone = comm.gather(mine, root=0)
    loader.close()
    if rank == 0:
        out = {
            "ranks": size,
            "data_ranks": data_ranks,
            "blocks": blocks,
            "global_batch": args.batch * data_ranks,
            "compute_ms": args.compute_ms,
            "epochs": args.epochs,
            "per_rank": everyone,
        }
        print(MARK + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

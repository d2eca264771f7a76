"""One rank of a torchrun-style job (no MPI): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the environment. Initializes gloo, iterates a ``DataStoreLoader`` and writes
what it saw to ``OUT.rank.npz``.

Usage: torch_loader_job.py DATASET OUT GLOBAL_BATCH EPOCHS PARTS HALO [STOP_AFTER]
  DATASET: a path; ``pathlib:PATH`` passes it as a ``pathlib.Path``.
  PARTS, HALO: e.g. ``2,1,1`` and ``1``, or ``-`` for whole samples; STOP_AFTER: rank 1
  stops iterating after that many batches and then waits (a timeout test).
"""

from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
import torch.distributed as dist

from datastore import DataStoreLoader


def main() -> None:
    path, out, gb, epochs, parts, halo = sys.argv[1:7]
    stop_after = int(sys.argv[7]) if len(sys.argv) > 7 else None
    dataset = pathlib.Path(path[len("pathlib:") :]) if path.startswith("pathlib:") else path
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spatial = None
    if parts != "-":
        spatial = {"parts": tuple(int(p) for p in parts.split(",")), "halo": int(halo)}
    loader = DataStoreLoader(dataset, global_batch_size=int(gb), seed=5, spatial=spatial, timeout=3)
    xs, ids = [], []
    try:
        for _ in range(int(epochs)):
            for i, b in enumerate(loader):
                if stop_after is not None and rank == 1 and i == stop_after:
                    time.sleep(8)  # stops taking batches (timeout=3): the peers must not hang
                    return
                xs.append(b["x"].numpy().copy())
                ids.append(b["idx"].numpy().copy())
    except Exception as exc:  # the test reads what the rank raised
        np.savez(f"{out}.{rank}.npz", error=f"{type(exc).__name__}: {exc}")
        return
    np.savez(
        f"{out}.{rank}.npz",
        x=np.stack(xs),
        idx=np.stack(ids),
        source=loader.source,
        keys=len(loader.store.keys),
        exchanged=loader.counters.bytes_exchanged,
    )
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

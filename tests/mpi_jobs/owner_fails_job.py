"""Two ranks exchanging under ``mpiexec -n 2``, nothing kept in memory (a 1 KiB budget for
samples of 4 KiB): the files of the samples rank 1 owns (the second half) are removed once the
loaders are open, so rank 1 cannot read them at step 4, where rank 0 waits for two of them.
Each rank writes ``OUT.RANK.json``: its error's kind and text, the seconds until it, the
batches it took.

Usage: owner_fails_job.py DIR OUT
"""

from __future__ import annotations

import json
import os
import sys
import time

from mpi4py import MPI

from datastore import DataStoreLoader, StoreOptions


def main() -> None:
    path, out = sys.argv[1:3]
    comm = MPI.COMM_WORLD
    store = StoreOptions(memory_budget="1K")
    loader = DataStoreLoader(path, 2, shuffle=False, timeout=30, prefetch=1, store=store)
    comm.Barrier()
    if comm.rank == 1:
        names = sorted(os.listdir(path))
        for name in names[len(names) // 2 :]:
            os.remove(os.path.join(path, name))
    comm.Barrier()
    row: dict = {"error": None, "batches": 0}
    t0 = time.monotonic()
    try:
        for _ in loader:
            row["batches"] += 1
    except Exception as exc:
        row.update(error=[type(exc).__name__, str(exc)], seconds=time.monotonic() - t0)
    with open(f"{out}.{comm.rank}.json.tmp", "w") as f:
        json.dump(row, f)
    os.replace(f"{out}.{comm.rank}.json.tmp", f"{out}.{comm.rank}.json")
    deadline = time.monotonic() + 45  # alive until rank 0 has its answer (an exit ends the job)
    while time.monotonic() < deadline and not os.path.exists(f"{out}.0.json"):
        time.sleep(0.05)
    os._exit(0)  # no teardown beside a peer that failed


if __name__ == "__main__":
    main()

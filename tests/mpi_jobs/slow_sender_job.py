"""Run under ``mpiexec -n 2 python -m mpi4py``: rank 1 passes a step's check, then is slow to
read a sample it sends (4 s, as a busy parallel file system can be), past the loader's 2 s
timeout; rank 0, its receives posted into its batch slot, times out in the exchange and
ends. Rank 1's bytes then move while rank 0 finalizes MPI, into buffers that must still be
alive (before, Open MPI wrote them into freed memory: rank 0 died of a segfault after its
clear error). Rank 0 then tries a new pass, which the failed exchange refuses. Each rank
writes its errors as a JSON row (``OUT.RANK.json``).

Usage: slow_sender_job.py DATASET OUT
"""

from __future__ import annotations

import sys
import time

from job_rows import write_row
from mpi4py import MPI

from datastore import DataStoreLoader
from datastore.store.store import Store

SLOW_CALL = 6  # rank 1's sixth sample sent: past step 0, after its step's check
SLOW_S = 4.0


def slow_sixth_read() -> None:
    lasting, calls = Store.lasting, [0]

    def slow(self: Store, key: int, field: str):
        calls[0] += 1
        if calls[0] == SLOW_CALL:
            time.sleep(SLOW_S)
        return lasting(self, key, field)

    Store.lasting = slow  # type: ignore[method-assign]


def main() -> None:
    path, out = sys.argv[1:3]
    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 1:
        slow_sixth_read()
    row: dict = {"rank": rank, "error": None, "steps": 0, "again": None}
    loader = DataStoreLoader(path, global_batch_size=8, seed=1, timeout=2)
    try:
        for _ in loader:
            row["steps"] += 1
    except Exception as exc:  # what each rank raised, for the test
        row["error"] = [type(exc).__name__, str(exc)]
    if rank == 0:  # a new pass after the timeout: refused at once, before any message
        t0 = time.monotonic()
        loader.set_epoch(1)
        try:
            next(iter(loader))
        except Exception as exc:
            row["again"] = [type(exc).__name__, str(exc), time.monotonic() - t0]
    write_row(out, rank, row)


if __name__ == "__main__":
    main()

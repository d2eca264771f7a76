"""Under ``mpiexec -n 2 python -m mpi4py``: rank 1 fails while rank 0 waits for its halo.

``raise``: rank 1 raises; ``python -m mpi4py`` aborts the whole job.
``stall``: rank 1 sleeps far past the 3 s group timeout; rank 0's receive times out and raises.

Usage: fail_job.py raise|stall
"""

from __future__ import annotations

import datetime
import sys
import time

import torch

from trainer.grid import ProcessGrid, init_distributed
from trainer.halo import halo_exchange


def main() -> None:
    mode = sys.argv[1]
    rank, _ = init_distributed(timeout=datetime.timedelta(seconds=3))
    pg = ProcessGrid.create((2, 1, 1))
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        time.sleep(300)
    halo_exchange(torch.zeros(1, 1, 4, 4, 4), pg, (1, 1, 1))
    print("rank 0 got a halo from a failed rank", flush=True)


if __name__ == "__main__":
    main()

"""Two ranks exchanging (MPI under ``mpiexec -n 2`` without ``-m mpi4py``, or
``torch.distributed`` with torchrun's variables); rank 1 ends its loop at its third batch by
HOW: ``fail`` (an uncaught ValueError), ``exit`` (``sys.exit(3)``), ``kill`` (``SIGKILL``) or
``break`` (then it lives on). Rank 0 iterates on and writes ``OUT.0.json``: its error's kind
and text.

Usage: peer_end_job.py mpi|torch HOW DATASET OUT
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> None:
    via, how, path, out = sys.argv[1:5]
    if via == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    else:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    from datastore import DataStoreLoader

    loader = DataStoreLoader(path, 2, seed=1, timeout=20, prefetch=1)
    if rank == 1:
        for i, _ in enumerate(loader):
            if i == 2:
                if how == "fail":
                    raise ValueError("boom at batch 2")
                if how == "exit":
                    sys.exit(3)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                break
        deadline = time.monotonic() + 30  # alive until rank 0 has learnt of the stop
        while time.monotonic() < deadline and not os.path.exists(f"{out}.0.json"):
            time.sleep(0.05)
        return
    row = {"error": None}
    t0 = time.monotonic()
    try:
        for _ in loader:
            pass
    except Exception as exc:
        row = {"error": [type(exc).__name__, str(exc)], "seconds": time.monotonic() - t0}
    with open(f"{out}.json.tmp", "w") as f:
        json.dump(row, f)
    os.replace(f"{out}.json.tmp", f"{out}.0.json")
    os._exit(0)  # the job ends here: no teardown with a peer that is gone


if __name__ == "__main__":
    main()

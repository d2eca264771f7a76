"""Under ``mpiexec -n 1 python -m mpi4py``: a service closes its MPI link while its pool is
still answering a request (a describe that takes 1 s), and a new request comes in meanwhile
(here from itself: one rank is both ends). Writes what each asker got as JSON to OUT.

Usage: peer_close_job.py OUT
"""

from __future__ import annotations

import json
import sys
import threading
import time

from mpi4py import MPI

from datastore.service.errors import ServiceError
from datastore.service.mpi_peers import MpiPeers

ANSWERING = threading.Event()


def answer(request: dict) -> object:
    ANSWERING.set()
    time.sleep(1.0)
    return "described"


def main() -> None:
    peers = MpiPeers(MPI.COMM_WORLD, answer, timeout_s=3)
    got: dict[str, object] = {}

    def ask(name: str) -> None:
        try:
            got[name] = peers.describe(0, "d")
        except ServiceError as exc:
            got[name] = [exc.code, str(exc)]

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert ANSWERING.wait(10)
    closing = threading.Thread(target=peers.close, kwargs={"stop_all": False})
    closing.start()  # waits for the pool's answer (1 s)
    time.sleep(0.3)
    ask("during_close")  # a request that reaches the link while its pool is shut
    first.join()
    closing.join()
    with open(sys.argv[1], "w") as fh:
        json.dump(got, fh)


if __name__ == "__main__":
    main()

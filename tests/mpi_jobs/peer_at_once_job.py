"""Under ``mpiexec -n 2 python -m mpi4py``: node 0 answers a fetch of samples it holds in RAM
on its link's thread (``at_once``) and every other request on its pool: a describe that waits
until a fetch was answered at once (so the link answers while the pool is busy), a fetch of a
sample not in RAM, a request ``at_once`` refuses. Node 1 asks them all at once and writes what
it got, and which thread answered each, as JSON to OUT; then, its link closed, a fetch.

Usage: peer_at_once_job.py OUT
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
from mpi4py import MPI

from datastore.service.errors import ServiceError
from datastore.service.mpi_peers import MpiPeers
from datastore.service.peer_link import Pieces

IN_RAM = {0, 1}  # node 0's samples in RAM; 2 is "on disk"
ANSWERED_AT_ONCE = threading.Event()
THREADS: dict[str, str] = {}


def sample(i: int) -> np.ndarray:
    return np.arange(4 * 8 * 8, dtype=np.float32).reshape(4, 8, 8) + 1000 * i


def box() -> tuple[slice, ...]:
    return (slice(1, 3), slice(0, 8), slice(0, 8))


def at_once(request: dict) -> object:
    if request["kind"] != "fetch" or not set(request["samples"]) <= IN_RAM:
        return None
    if request["samples"] == [1]:
        raise ServiceError("OUT_OF_RANGE", "sample 1 is refused")
    THREADS[f"fetch {request['samples']}"] = threading.current_thread().name
    ANSWERED_AT_ONCE.set()
    return Pieces([(sample(i), box()) for i in request["samples"]])


def answer(request: dict) -> object:
    if request["kind"] == "describe":
        THREADS["describe"] = threading.current_thread().name
        return "busy" if ANSWERED_AT_ONCE.wait(30) else "no fetch was answered meanwhile"
    THREADS[f"fetch {request['samples']}"] = threading.current_thread().name
    return Pieces([(sample(i), box()) for i in request["samples"]])


def fetched(peers: MpiPeers, samples: list[int]) -> object:
    want = np.concatenate([sample(i)[box()].reshape(-1) for i in samples])
    out = np.zeros(want.nbytes, np.uint8)
    try:
        peers.fetch(0, {"kind": "fetch", "samples": samples}, out)
    except ServiceError as exc:
        return [exc.code, str(exc)]
    return bool(np.array_equal(out.view(np.float32), want))


def main() -> None:
    comm = MPI.COMM_WORLD
    peers = MpiPeers(comm, answer, timeout_s=20, at_once=at_once)
    got: dict[str, object] = {}
    if comm.Get_rank() == 1:
        got["thread_multiple"] = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        described: list[object] = []
        asks = threading.Thread(target=lambda: described.append(peers.describe(0, "d")))
        asks.start()  # the pool's thread waits in it until a fetch was answered at once
        got["resident"] = fetched(peers, [0])
        got["on_disk"] = fetched(peers, [2, 0])
        got["refused"] = fetched(peers, [1])
        asks.join()
        got["described"] = described
    comm.Barrier()
    threads = comm.gather(THREADS, root=1)
    peers.close(stop_all=False)
    if comm.Get_rank() == 1:
        got["closed"] = fetched(peers, [0])
        got["threads"] = threads[0]
        with open(sys.argv[1], "w") as fh:
            json.dump(got, fh)


if __name__ == "__main__":
    main()

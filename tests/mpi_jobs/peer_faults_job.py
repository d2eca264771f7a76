"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 fetches from node 0 through ``MpiPeers``
(timeout 0.5 s) while node 0 misbehaves, by hand on its own duplicate of the communicator:

1. it takes the request and never answers (a peer that hangs);
2. it sends the reply's envelope (``ok``: the bytes follow) and then never the bytes (a peer
   that dies mid-transfer);
3. it answers 1.5 s late, after node 1 abandoned the request (``Pending.abandon``);
4. it answers a last request at once, into two buffers (``segments``).

Node 1 writes each case's error code and message, and the last reply, as JSON to OUT.

Usage: peer_faults_job.py OUT
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI
from peer_job import failed

from datastore.service.mpi_peers import REQUEST, MpiPeers


def owner(comm: MPI.Comm) -> None:
    """Node 0, by hand: the four cases in order."""
    first = comm.recv(source=1, tag=REQUEST)  # 1: never answered
    del first
    second = comm.recv(source=1, tag=REQUEST)  # 2: the envelope, never the bytes
    comm.send({"rid": second["rid"], "ok": 8, "runs": [8]}, dest=1, tag=second["tag"])
    third = comm.recv(source=1, tag=REQUEST)  # 3: 1.5 s late
    time.sleep(1.5)
    comm.send({"rid": third["rid"], "ok": 8, "runs": [8]}, dest=1, tag=third["tag"])
    comm.Send(np.full(8, 3, np.uint8), dest=1, tag=third["tag"])
    last = comm.recv(source=1, tag=REQUEST)  # 4: at once, in two runs
    comm.send({"rid": last["rid"], "ok": 8, "runs": [3, 5]}, dest=1, tag=last["tag"])
    comm.Send(np.arange(3, dtype=np.uint8), dest=1, tag=last["tag"])
    comm.Send(np.arange(3, 8, dtype=np.uint8), dest=1, tag=last["tag"])


def main() -> None:
    world = MPI.COMM_WORLD
    if world.Get_rank() == 0:
        comm = world.Dup()  # as MpiPeers does on node 1
        owner(comm)
        world.Barrier()
        comm.Free()
        return
    peers = MpiPeers(world, lambda request: None, timeout_s=0.5)
    out = np.zeros(8, np.uint8)
    got = {
        "hangs": failed(lambda: peers.fetch(0, {"kind": "fetch"}, out)),
        "dies": failed(lambda: peers.fetch(0, {"kind": "fetch"}, out)),
    }
    late = peers.start(0, {"kind": "fetch"}, out)
    late.abandon()
    got["abandoned_waits"] = late.wait(5.0)
    got["abandoned"] = failed(late.result)
    time.sleep(2.0)  # the late reply is in MPI's queue by now
    two = [np.zeros(3, np.uint8), np.zeros(5, np.uint8)]
    peers.fetch(0, {"kind": "fetch"}, two)
    got["last"] = [b.tolist() for b in two]
    got["late_bytes_landed"] = out.tolist()
    with open(sys.argv[1], "w") as fh:
        json.dump(got, fh)
    world.Barrier()
    peers.close(stop_all=False)


if __name__ == "__main__":
    main()

"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 asks node 0 through ``MpiPeers`` (2 reply
tags, timeout 0.5 s); node 0 answers by hand on the link's communicator. Two fetches' envelopes
come at once but their bytes only after both gave up (their receives cancelled), bytes that
happen to read as the envelopes of the next two requests. Then, on those tags, an ask and a
fetch whose receives go out with it (``expect``), its bytes sent 0.2 s after its request: each
gets its own answer (the late bytes were received aside by their size, never read as an
envelope). Node 1 writes what it got as JSON to OUT.

Usage: peer_stray_job.py OUT
"""

from __future__ import annotations

import json
import pickle
import sys
import time

import numpy as np
from mpi4py import MPI
from peer_job import failed

from datastore.service.mpi_peers import REQUEST, MpiPeers
from datastore.service.peer_link import expect

# the late bytes: samples that happen to read as the envelopes of the next two requests
FORGED = [
    pickle.dumps({"rid": 2, "reply": "forged"}),
    pickle.dumps({"rid": 3, "reply": {"error": "forged", "code": "NOT_FOUND"}}),
]
SIZE = max(len(f) for f in FORGED)


def owner(comm: MPI.Comm) -> None:
    link = comm.Dup()  # (the asker's MpiPeers duplicates the communicator)
    fetches = [link.recv(source=1, tag=REQUEST) for _ in range(2)]
    for f in fetches:
        link.send({"rid": f["rid"], "ok": SIZE, "runs": [SIZE]}, dest=1, tag=f["tag"])
    time.sleep(2.0)  # past the asker's 0.5 s
    for f, forged in zip(fetches, FORGED, strict=True):
        link.Send(np.frombuffer(forged.ljust(SIZE, b"\0"), np.uint8), dest=1, tag=f["tag"])
    comm.send("sent", dest=1)  # (the next requests come now: answered within their timeout)
    ask = link.recv(source=1, tag=REQUEST)
    link.send({"rid": ask["rid"], "reply": ask["value"]}, dest=1, tag=ask["tag"])
    told = link.recv(source=1, tag=REQUEST)
    time.sleep(0.2)  # (the asker's link polls its reply tag meanwhile)
    link.Send(np.full(16, 9, np.uint8), dest=1, tag=told["data_tag"])
    comm.Barrier()
    link.Free()


def asker(comm: MPI.Comm) -> None:
    peers = MpiPeers(comm, lambda request: None, timeout_s=0.5, tag_span=2)
    outs = [np.zeros(SIZE, np.uint8) for _ in range(2)]
    pending = [peers.start(0, {"kind": "fetch"}, out) for out in outs]
    got = {"fetches": [failed(p.result) for p in pending]}
    got["fetch_bytes"] = [sorted(set(out.tolist())) for out in outs]
    comm.recv(source=0)  # their bytes went out
    asked: list[object] = []
    got["ask"] = failed(lambda: asked.append(peers.ask(0, {"kind": "echo", "value": "a"})))
    got["asked"] = asked
    told = np.zeros(16, np.uint8)
    got["told"] = failed(lambda: peers.fetch(0, {"kind": "fetch", "expect": expect([16])}, told))
    got["told_bytes"] = sorted(set(told.tolist()))
    with open(sys.argv[1], "w") as fh:
        json.dump(got, fh)
    comm.Barrier()
    peers.close(stop_all=False)


if __name__ == "__main__":
    world = MPI.COMM_WORLD
    owner(world) if world.Get_rank() == 0 else asker(world)

"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 asks node 0 through ``MpiPeers`` with 3 reply
tags, so tags come round every 3 requests. Its first pickled request and its first raw fetch
give up before node 0's slow answer comes; the later requests that reuse those tags must get
their own answers, not the late ones. Rank 1 writes what it got as JSON to OUT.

Usage: peer_tags_job.py OUT
"""

from __future__ import annotations

import time

import numpy as np
from peer_job import run

from datastore.service.errors import ServiceError
from datastore.service.mpi_peers import MpiPeers


def answer(request: dict) -> object:
    if request.get("slow"):
        time.sleep(1.5)  # past the asker's 0.5 s timeout
    if request["kind"] == "fetch":
        return np.full(request["nbytes"], request["value"], dtype=np.uint8)
    return request["value"]


def asks(peers: MpiPeers) -> dict:
    got: dict[str, object] = {}
    try:
        peers.ask(0, {"kind": "echo", "value": "late", "slow": True})
    except ServiceError as exc:
        got["first"] = exc.code
    out = np.zeros(16, dtype=np.uint8)
    try:
        peers.fetch(0, {"kind": "fetch", "value": 7, "slow": True}, out)
    except ServiceError as exc:
        got["first_fetch"] = exc.code
    time.sleep(2.0)  # both late replies are in MPI's queue by now
    got["asks"] = [peers.ask(0, {"kind": "echo", "value": i}) for i in range(6)]
    fetched = []
    for value in (20, 21, 22, 23):
        out = np.zeros(16, dtype=np.uint8)
        peers.fetch(0, {"kind": "fetch", "value": value}, out)
        fetched.append(sorted(set(out.tolist())))
    got["fetches"] = fetched
    return got


if __name__ == "__main__":
    run(answer, asks, timeout_s=0.5, tag_span=3)

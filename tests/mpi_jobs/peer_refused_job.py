"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 fetches from node 0 through ``MpiPeers`` (3
reply tags, timeout 1 s) with requests that tell their sizes (their receives posted with the
request). Node 0 answers ``holds`` bytes of ``value``, after ``nap`` s; a ``refuse`` fetch it
refuses after 1.3 s (past the asker's timeout: it then sends no bytes).

Node 1: a refused fetch times out; at once three fetches together (the third gets the tag whose
late bytes are awaited, told its sizes by an envelope; the refusal comes while it waits on that
tag); then three together again. Then another refused fetch times out, node 1 waits till the
refusal came (no request on its tag), and three together again. It writes the errors, the bytes
and how many fetches of each three were told their sizes by an envelope (the first leg > 0) as
JSON to OUT.

Usage: peer_refused_job.py OUT
"""

from __future__ import annotations

import time

import numpy as np
from peer_job import asker_stats, failed, run

from datastore.service.errors import ServiceError
from datastore.service.mpi_peers import MpiPeers
from datastore.service.peer_link import expect
from datastore.service.peer_stats import read_stats


def answer(request: dict) -> object:
    if request.get("refuse"):
        time.sleep(1.3)  # past the asker's 1 s timeout
        raise ServiceError("NOT_FOUND", "no sample 99 here")
    time.sleep(request.get("nap", 0.0))
    return np.full(request["holds"], request["value"], dtype=np.uint8)


def ask(value: int, **more: object) -> dict:
    return {"kind": "fetch", "value": value, "holds": 16, "expect": expect([16]), **more}


def three(peers: MpiPeers, first: int, nap: float) -> tuple[list[list[int]], int]:
    """Three fetches at once (values ``first``...): their bytes, and how many were told their
    sizes by an envelope."""
    before = len(read_stats(asker_stats())["legs"])
    outs = [np.zeros(16, np.uint8) for _ in range(3)]
    pending = [peers.start(0, ask(first + k, nap=nap), outs[k]) for k in range(3)]
    for p in pending:
        p.result()
    legs = [leg[0] for leg in read_stats(asker_stats())["legs"][before:]]
    return [sorted(set(o.tolist())) for o in outs], sum(leg > 0 for leg in legs)


def asker(peers: MpiPeers) -> dict:
    got: dict[str, object] = {}
    refused = np.zeros(16, np.uint8)
    got["timed_out"] = failed(lambda: peers.fetch(0, ask(1, refuse=True), refused))
    got["while_refused"] = three(peers, 10, 0.6)  # the refusal comes meanwhile
    got["after_refused"] = three(peers, 20, 0.2)
    got["timed_out_again"] = failed(lambda: peers.fetch(0, ask(2, refuse=True), refused))
    time.sleep(0.8)  # the refusal came, no request on its tag
    got["after_quiet_refusal"] = three(peers, 30, 0.2)
    got["refused_bytes"] = sorted(set(refused.tolist()))
    return got


if __name__ == "__main__":
    run(answer, asker, timeout_s=1.0, tag_span=3)

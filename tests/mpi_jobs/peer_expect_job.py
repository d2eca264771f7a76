"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 fetches from node 0 through ``MpiPeers``
(3 reply tags, timeout 0.5 s) requests that tell the reply's message sizes (``expect``), so
their receives go out with the request. Node 0 answers each with ``nbytes`` bytes of the
request's ``value`` (one message; the link cuts it as the asker expects), after 1.5 s where the
request is ``slow``, with an error where it says ``fail``.

Node 1, in order: a fetch into two buffers; four at once (3 tags: the fourth waits for
one to be free), the first answered last; one expecting fewer bytes than node 0 holds; one
node 0 refuses; one that times out and one abandoned (node 0 answers both late, on their tags);
another abandoned at once and, while no tag is free, three more; then, once the late bytes
came, four more; then one of no bytes that node 0 refuses. It writes each result, its
buffers' bytes and each fetch's legs (the first is 0 for a fetch whose receives went out with
the request) as JSON to OUT.

Usage: peer_expect_job.py OUT
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
    if request.get("slow"):
        time.sleep(1.5)  # past the asker's 0.5 s timeout
    time.sleep(request.get("nap", 0.0))
    if request.get("fail"):
        raise ServiceError("NOT_FOUND", "no sample 99 here")
    return np.full(request["holds"], request["value"], dtype=np.uint8)


def ask(value: int, sizes: list[int], **more: object) -> dict:
    return {"kind": "fetch", "value": value, "holds": sum(sizes), "expect": expect(sizes), **more}


def values(buffers: list[np.ndarray]) -> list[list[int]]:
    return [sorted(set(b.tolist())) for b in buffers]


def asker(peers: MpiPeers) -> dict:
    got: dict[str, object] = {}
    two = [np.zeros(8, np.uint8), np.zeros(8, np.uint8)]
    peers.fetch(0, ask(1, [8, 8]), two)
    got["split"] = values(two)
    outs = [np.zeros(16, np.uint8) for _ in range(4)]  # 4 at once, the first answered last
    naps = [0.3, 0.0, 0.0, 0.0]
    pending = [peers.start(0, ask(40 + k, [16], nap=naps[k]), outs[k]) for k in range(4)]
    for p in pending:
        p.result()
    got["at_once"] = values(outs)
    short = np.zeros(10, np.uint8)
    got["short"] = failed(lambda: peers.fetch(0, {**ask(2, [10]), "holds": 16}, short))
    got["short_bytes"] = values([short])
    refused = np.zeros(8, np.uint8)
    got["refused"] = failed(lambda: peers.fetch(0, ask(3, [8], fail=True), refused))
    got["refused_bytes"] = values([refused])
    slow = np.zeros(16, np.uint8)
    got["timed_out"] = failed(lambda: peers.fetch(0, ask(7, [16], slow=True), slow))
    dropped = np.zeros(16, np.uint8)
    late = peers.start(0, ask(9, [16], slow=True), dropped)
    late.abandon()
    got["abandoned"] = [late.wait(5.0), *failed(late.result)]
    third = np.zeros(16, np.uint8)
    last = peers.start(0, ask(11, [16], slow=True), third)
    last.abandon()
    last.wait(5.0)
    got["while_no_tag_is_free"] = []
    for value in (20, 21, 22):  # every tag awaits late bytes: told their sizes instead
        out = np.zeros(16, np.uint8)
        peers.fetch(0, ask(value, [16]), out)
        got["while_no_tag_is_free"].append(values([out]))
    time.sleep(2.5)  # the late bytes came, and were taken aside
    got["late_bytes_landed"] = values([slow, dropped, third])
    got["after"] = []
    for value in (30, 31, 32, 33):
        out = np.zeros(16, np.uint8)
        peers.fetch(0, ask(value, [16]), out)
        got["after"].append(values([out]))
    got["legs"] = [leg[0] for leg in read_stats(asker_stats())["legs"]]
    got["empty_refused"] = failed(lambda: peers.fetch(0, ask(5, [], fail=True), []))
    return got


if __name__ == "__main__":
    run(answer, asker, timeout_s=0.5, tag_span=3)

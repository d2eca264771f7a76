"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 asks node 0 through ``MpiPeers`` (3 reply tags,
timeout 0.5 s) requests that cannot go out: a fetch whose request holds a lock (no pickle), and
fetches into two buffers the second of which is read-only (MPI refuses to receive into it, after
the first buffer's receive was posted), fetches into a read-only buffer told their sizes by an
envelope (its bytes then received aside), each twice per tag; then fetches that tell their sizes,
each tag twice (their receives posted with the request). Then the same with the link's thread
posting the requests (as where MPI is not ``MPI_THREAD_MULTIPLE``). Node 0 answers a fetch with
``holds`` bytes of ``value``, and a request of kind ``lock`` with a reply that cannot be
pickled (4 per round). Node 1 writes the errors, the bytes and each fetch's legs (the first 0
where the receives went out with the request) as JSON to OUT.

Usage: peer_unsent_job.py OUT
"""

from __future__ import annotations

import threading

import numpy as np
from peer_job import asker_stats, run

from datastore.service.mpi_peers import MpiPeers
from datastore.service.peer_link import expect
from datastore.service.peer_stats import read_stats


def answer(request: dict) -> object:
    if request["kind"] == "lock":  # a reply that cannot be pickled
        return threading.Lock()
    return np.full(request["holds"], request["value"], dtype=np.uint8)


def ask(value: int, sizes: list[int], **more: object) -> dict:
    return {"kind": "fetch", "value": value, "holds": sum(sizes), "expect": expect(sizes), **more}


def failed(call) -> list[str]:  # type: ignore[no-untyped-def]
    """``call()``'s error as ``[type, code, message]`` (a raw exception: its type and text)."""
    try:
        call()
    except Exception as exc:
        return [type(exc).__name__, getattr(exc, "code", ""), str(exc)]
    return ["no error", "", ""]


def values(buffers: list[np.ndarray]) -> list[list[int]]:
    return [sorted(set(b.tolist())) for b in buffers]


def rounds(peers: MpiPeers, got: dict, name: str) -> None:
    got[name + "_unpicklable"] = [
        failed(lambda: peers.fetch(0, ask(1, [16], hook=threading.Lock()), np.zeros(16, np.uint8)))
        for _ in range(6)
    ]
    firsts, errors = [], []
    for _ in range(6):
        first, second = np.zeros(8, np.uint8), np.zeros(8, np.uint8)
        second.flags.writeable = False
        errors.append(failed(lambda f=first, s=second: peers.fetch(0, ask(2, [8, 8]), [f, s])))
        firsts.append(first)
    got[name + "_read_only"] = errors
    errors = []
    for _ in range(6):  # told the sizes by an envelope: refused once the envelope came
        read_only = np.zeros(16, np.uint8)
        read_only.flags.writeable = False
        told = {"kind": "fetch", "value": 3, "holds": 16}
        errors.append(failed(lambda r=read_only, t=told: peers.fetch(0, t, r)))
    got[name + "_told_read_only"] = errors
    got[name + "_unanswerable"] = [failed(lambda: peers.ask(0, {"kind": "lock"})) for _ in range(4)]
    got[name + "_after"] = []
    for value in range(20, 26):
        out = np.zeros(8, np.uint8)
        peers.fetch(0, ask(value, [8]), out)
        got[name + "_after"].append(values([out]))
    got[name + "_failed_buffers"] = values(firsts)  # no late receive took a later fetch's bytes


def asker(peers: MpiPeers) -> dict:
    got: dict[str, object] = {}
    rounds(peers, got, "asker")
    peers._multiple = False  # the link's thread posts the requests
    rounds(peers, got, "link")
    got["legs"] = [leg[0] for leg in read_stats(asker_stats())["legs"]]
    return got


if __name__ == "__main__":
    run(answer, asker, timeout_s=0.5, tag_span=3)

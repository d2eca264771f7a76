"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 fetches from node 0 parts of samples that
node 0 sends straight from its arrays (``Pieces``), received straight into boxes of larger
arrays (a block's part inside the volume amid its halo), not contiguous on either side; node 1
writes what it found as JSON to OUT.

Usage: peer_boxes_job.py OUT
"""

from __future__ import annotations

import numpy as np
from peer_job import asker_stats, run

from datastore.service.errors import ServiceError
from datastore.service.mpi_peers import MpiPeers
from datastore.service.peer_link import Pieces
from datastore.service.peer_stats import read_stats

# sample i's fields, as node 0 stores them (distinct values everywhere)
STORE = {}
for i in range(3):
    STORE[i, "v"] = np.arange(2 * 6 * 7 * 5, dtype=np.float32).reshape(2, 6, 7, 5) + 1000 * i
    STORE[i, "s"] = np.arange(9, dtype=np.int16).reshape(9) - 10 * i
# (the part of the sample sent, where it lands in the receiver's box of BOX[f] with its halo)
CASES = {
    "low edge": ((slice(0, 2), slice(0, 3), slice(0, 4), slice(0, 5)),  # halo before: 1 2 1
                 (slice(0, 2), slice(1, 4), slice(2, 6), slice(1, 6))),
    "high edge": ((slice(0, 2), slice(4, 6), slice(3, 7), slice(2, 5)),  # halo after
                  (slice(0, 2), slice(0, 2), slice(0, 4), slice(0, 3))),
    "middle": ((slice(1, 2), slice(2, 4), slice(1, 6), slice(1, 4)),  # strided on both sides
               (slice(0, 1), slice(1, 3), slice(1, 6), slice(1, 4))),
}  # fmt: skip
BOX = {"low edge": (2, 4, 6, 7), "high edge": (2, 3, 4, 4), "middle": (1, 4, 7, 5)}
SENTINEL = -7


def answer(request: dict) -> object:
    src = CASES[request["case"]][0]
    whole = (slice(0, 9),)
    return Pieces([(STORE[i, "v"], src) for i in request["samples"]] +
                  [(STORE[i, "s"], whole) for i in request["samples"]])  # fmt: skip


def fetch(peers: MpiPeers, case: str, samples: list[int], dst_box: tuple) -> dict:
    """Fetch ``case``'s parts of ``samples`` into boxes of sentinel-filled arrays."""
    src = CASES[case][0]
    vols = [np.full(BOX[case], SENTINEL, np.float32) for _ in samples]
    flat = [np.full(9, SENTINEL, np.int16) for _ in samples]
    out = [(v, dst_box) for v in vols] + [(s, (slice(0, 9),)) for s in flat]
    peers.fetch(0, {"kind": "fetch", "case": case, "samples": samples}, out)
    inside, halo, whole = True, True, True
    for v, s, i in zip(vols, flat, samples, strict=True):
        inside &= np.array_equal(v[dst_box], STORE[i, "v"][src])
        around = np.ones(v.shape, bool)
        around[dst_box] = False
        halo &= bool((v[around] == 0).all())
        whole &= np.array_equal(s, STORE[i, "s"])
    return {"inside": inside, "halo zeroed": halo, "whole": whole}


def asks(peers: MpiPeers) -> dict:
    got = {case: fetch(peers, case, [2, 0], dst) for case, (_, dst) in CASES.items()}
    got["messages"] = read_stats(asker_stats())["fetches"]
    wrong = (slice(0, 2), slice(0, 3), slice(0, 4), slice(0, 4))  # a box of other bytes
    try:
        fetch(peers, "low edge", [1], wrong)
    except ServiceError as exc:
        got["mismatch"] = [exc.code, str(exc)]
    return got


if __name__ == "__main__":
    run(answer, asks, timeout_s=10)

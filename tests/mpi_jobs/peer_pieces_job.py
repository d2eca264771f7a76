"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 fetches from node 0 boxes of three fields of
two samples, which node 0 sends straight from its arrays (``Pieces``: contiguous runs, a box of
short runs packed), into one buffer; node 1 writes the bytes it got, what it expected, and the
messages' sizes, as JSON to OUT.

Usage: peer_pieces_job.py OUT
"""

from __future__ import annotations

import numpy as np
from peer_job import asker_stats, run

from datastore.service.mpi_peers import MpiPeers
from datastore.service.peer_link import Pieces
from datastore.service.peer_stats import read_stats

# sample i's fields, as node 0 stores them (distinct values everywhere)
STORE = {}
for i in range(3):
    STORE[i, "x"] = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5) + 1000 * i
    STORE[i, "y"] = np.arange(7, dtype=np.int16) - 10 * i
    STORE[i, "z"] = np.arange(3 * 200 * 128, dtype=np.float32).reshape(3, 200, 128) - i
BOX = {
    "x": (slice(1, 4), slice(2, 6), slice(0, 5)),  # 3 runs of 80 bytes: packed
    "y": (slice(0, 7),),  # contiguous
    "z": (slice(0, 3), slice(10, 150), slice(0, 128)),  # 3 runs of 70 KiB: sent as they are
}


def answer(request: dict) -> object:
    return Pieces([(STORE[i, f], BOX[f]) for f in request["fields"] for i in request["samples"]])


def asks(peers: MpiPeers) -> dict:
    samples, fields = [2, 0], ["x", "y", "z"]
    want = np.concatenate(
        [STORE[i, f][BOX[f]].reshape(-1).view(np.uint8) for f in fields for i in samples]
    )
    out = np.zeros(want.nbytes, dtype=np.uint8)
    peers.fetch(0, {"kind": "fetch", "samples": samples, "fields": fields}, out)
    same = bool(np.array_equal(out, want))
    got = {"same": same, "nbytes": int(out.nbytes), "received": peers.bytes_received}
    got["messages"] = read_stats(asker_stats())["fetches"]
    return got


if __name__ == "__main__":
    run(answer, asks, timeout_s=10)

"""Under ``mpiexec -n 2 python -m mpi4py``: node 1 fetches from node 0 boxes of two fields of
three samples, which node 0 sends straight from its arrays (``Pieces``) and node 1 receives
straight into their places in one packed buffer (``boxes``); node 1 writes the buffer's bytes,
and what it expected them to be, as JSON to OUT.

Usage: peer_pieces_job.py OUT
"""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

from datastore.service.peers import MpiPeers, Pieces

# sample i's fields, as node 0 stores them (distinct values everywhere)
STORE = {
    (i, "x"): np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5) + 1000 * i for i in range(3)
}
STORE.update({(i, "y"): np.arange(7, dtype=np.int16) - 10 * i for i in range(3)})
SRC = {"x": (slice(1, 4), slice(2, 6), slice(0, 5)), "y": (slice(0, 7),)}  # inside the volume
SHAPE = {"x": (4, 6, 7), "y": (7,)}  # the delivered box: x has 2 columns of halo beyond
INNER = {"x": (slice(0, 3), slice(0, 4), slice(1, 6)), "y": (slice(0, 7),)}  # SRC's place


def answer(request: dict) -> object:
    return Pieces([(STORE[(i, f)], SRC[f]) for f in request["fields"] for i in request["samples"]])


def main() -> None:
    comm = MPI.COMM_WORLD
    peers = MpiPeers(comm, answer, timeout_s=10)
    if comm.Get_rank() == 1:
        samples, fields = [2, 0], ["x", "y"]
        dtypes = {"x": np.float32, "y": np.int16}
        sizes = [len(samples) * np.prod(SHAPE[f]) * np.dtype(dtypes[f]).itemsize for f in fields]
        out = np.full(sum(sizes), 0xEE, dtype=np.uint8)  # halo bytes must stay as they are
        arrays, at = {}, 0
        for f, n in zip(fields, sizes, strict=True):
            arrays[f] = out[at : at + n].view(dtypes[f]).reshape(len(samples), *SHAPE[f])
            at += n
        expected = {f: arrays[f].copy() for f in fields}
        for f in fields:
            for pos, i in enumerate(samples):
                expected[f][pos][INNER[f]] = STORE[(i, f)][SRC[f]]
        boxes = [(arrays[f][pos], INNER[f]) for f in fields for pos in range(len(samples))]
        peers.fetch(0, {"kind": "fetch", "samples": samples, "fields": fields}, out, boxes)
        want = np.concatenate([expected[f].reshape(-1).view(np.uint8) for f in fields])
        got = {"got": out.tolist(), "want": want.tolist(), "received": peers.bytes_received}
        with open(sys.argv[1], "w") as fh:
            json.dump(got, fh)
    comm.Barrier()
    peers.close(stop_all=False)


if __name__ == "__main__":
    main()

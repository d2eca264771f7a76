"""Under ``mpiexec -n 2 python -m mpi4py`` with CMA off (``MPIR_CVAR_CH4_CMA_ENABLE=0``: a large
message moves through shared memory a piece per progress call of both sides): node 1 fetches
from node 0 through ``MpiPeers`` (3 reply tags, timeout 0.5 s) a batch slot's 32 MiB, its
receive posted with the request. Node 0's link thread sends the first pieces, then stalls for
2.5 s (a peer busy mid-reply): node 1's receive is matched, so MPI cannot cancel it, and the fetch
fails at its deadline (plus ``CANCEL_S``) while the rest of the bytes are still to land.

Node 1 gives the slot back to a :class:`SlotRing` as a stream does, records whether the ring
lends it again at once, else waits until it does, then reuses it (writes 0xEE) and checks that
no byte of node 0's lands there after; then three more fetches (each tag once). Then another
such fetch, and node 1 closes its link once its first pieces landed, while node 0 stalls:
whether its slot is lent again; then node 1 ends, the rest of the bytes still to come. It
writes what it saw as JSON to OUT.

Usage: peer_lent_job.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI
from peer_job import asker_stats, failed

from datastore.service.mpi_peers import MpiPeers
from datastore.service.peer_link import expect
from datastore.service.peer_stats import STATS_ENV, read_stats
from datastore.service.resident import Fetching
from datastore.service.stream import SlotRing

NBYTES = 32 << 20
STALL_S = 2.5


def answer(request: dict) -> object:
    return np.full(request["holds"], request["value"], dtype=np.uint8)


def ask(value: int, nbytes: int, **more: object) -> dict:
    return {"kind": "fetch", "value": value, "holds": nbytes, "expect": expect([nbytes]), **more}


def stalling(peers: MpiPeers) -> None:
    """Node 0's link thread: after sending the first pieces of a ``stall`` fetch's reply, it
    makes no MPI call for ``stall`` s."""
    send = peers._send

    def _send(dest: int, request: dict, reply: object, raw: list[np.ndarray] | None) -> None:
        send(dest, request, reply, raw)
        if request.get("stall"):
            for _ in range(3):  # the first pieces out: node 1's receive is matched
                MPI.Request.Testall(peers._sends[-1][0])
            time.sleep(request["stall"])

    peers._send = _send  # type: ignore[method-assign]


def asker(peers: MpiPeers) -> dict:
    got: dict[str, object] = {}
    ring, stop = SlotRing([], 1, 1, shared=False), threading.Event()
    slot = ring.take(stop)
    out, asked = np.zeros(NBYTES, np.uint8), time.monotonic()
    fetching = Fetching(frozenset({0}), [peers.start(0, ask(7, NBYTES, stall=STALL_S), out)], [])
    got["failed"] = failed(lambda: fetching.result(stop))
    fetching.abandon()  # as the stream does with a batch that failed
    got["sevens_at_failure"] = int(np.count_nonzero(out == 7))
    ring.give(slot, fetching.freed)
    got["lent_at_once"] = lent = ring.poll()
    if lent is None:
        bound = threading.Timer(10.0, stop.set)  # (a slot never freed fails the test)
        bound.start()
        got["lent_later"] = ring.take(stop)
        bound.cancel()
    got["sevens_when_lent"] = int(np.count_nonzero(out == 7))
    out.fill(0xEE)  # the slot reused: the next batch's bytes
    time.sleep(max(0.0, asked + STALL_S + 1.0 - time.monotonic()))  # all of node 0's came
    got["reused"] = sorted(set(out.tolist()))
    got["after"] = []
    for value in (30, 31, 32):
        again = np.zeros(16, np.uint8)
        peers.fetch(0, ask(value, 16), again)
        got["after"].append(sorted(set(again.tolist())))
    got["legs"] = [leg[0] for leg in read_stats(asker_stats())["legs"]]
    closing(peers, got)
    return got


def closing(peers: MpiPeers, got: dict) -> None:
    """Node 1's link closes while a fetch's bytes are coming (its first pieces landed, node 0's
    link stalled): the fetch fails, and its slot is not lent again. Node 1 then ends at once:
    the rest of the bytes land while it finalizes MPI, in buffers still alive (before, Open
    MPI wrote them into freed memory in ``MPI_Finalize``: a segfault)."""
    ring, stop = SlotRing([], 1, 1, shared=False), threading.Event()
    slot = ring.take(stop)
    out = np.zeros(NBYTES, np.uint8)
    peers.timeout_s = 30.0  # (the fetch waits for its bytes: closing ends it, not its deadline)
    fetching = Fetching(frozenset({0}), [peers.start(0, ask(8, NBYTES, stall=STALL_S), out)], [])
    deadline = time.monotonic() + 30.0
    while not out[0] and time.monotonic() < deadline:
        time.sleep(0.001)  # (node 1's link moves the first pieces in)
    got["landed_before_close"] = int(out[0])
    peers.close(stop_all=False)
    got["closed"] = failed(lambda: fetching.result(stop))
    ring.give(slot, fetching.freed)
    got["lent_after_close"] = ring.poll()
    if got["lent_after_close"] is not None:  # the slot reused: the next batch's bytes
        out.fill(0xEE)
        while time.monotonic() < deadline and np.count_nonzero(out == 8) < NBYTES:
            MPI.COMM_WORLD.Iprobe()  # (MPI moves the bytes still coming, over 0xEE)
        got["after_close"] = sorted(set(out.tolist()))


def main() -> None:
    """As :func:`peer_job.run`, but node 0's main thread waits for node 1's answers on the
    file system, not in a barrier (whose progress would move the bytes its link stalls)."""
    comm = MPI.COMM_WORLD
    os.environ[STATS_ENV] = sys.argv[1] + ".stats{node}"
    peers = MpiPeers(comm, answer, timeout_s=0.5, tag_span=3)
    if comm.Get_rank() == 0:
        stalling(peers)
        deadline = time.monotonic() + 60.0
        while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
        comm.Barrier()
        peers.close(stop_all=False)
    else:
        got = asker(peers)  # (its link closed)
        with open(sys.argv[1] + ".part", "w") as fh:
            json.dump(got, fh)
        os.replace(sys.argv[1] + ".part", sys.argv[1])
        comm.Barrier()


if __name__ == "__main__":
    main()

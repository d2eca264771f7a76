"""What the two-node ``MpiPeers`` jobs share: node 0 answers, node 1 asks and writes what it
got as JSON to OUT (the job's first argument)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from datastore.service.errors import ServiceError
from datastore.service.mpi_peers import MpiPeers
from datastore.service.peer_stats import STATS_ENV


def asker_stats() -> str:
    """Where node 1's link records its fetches (``read_stats``)."""
    return sys.argv[1] + ".stats1"


def failed(call: Callable[[], object]) -> list[str]:
    """``call()``'s error as ``[code, message]`` (``["no error", ""]`` if it raised none)."""
    try:
        call()
    except ServiceError as exc:
        return [exc.code, str(exc)]
    return ["no error", ""]


def run(answer: Callable[[dict], Any], asks: Callable[[MpiPeers], dict], **options: Any) -> None:
    """Under ``mpiexec -n 2``: both nodes link with ``MpiPeers(answer, **options)``, each
    recording its fetches (``$DATASTORE_PEER_STATS``); node 1 writes ``asks(peers)`` as JSON
    to OUT; then both close the link together."""
    comm = MPI.COMM_WORLD
    os.environ[STATS_ENV] = sys.argv[1] + ".stats{node}"
    peers = MpiPeers(comm, answer, **options)
    if comm.Get_rank() == 1:
        got = asks(peers)
        with open(sys.argv[1], "w") as fh:
            json.dump(got, fh)
    comm.Barrier()
    peers.close(stop_all=False)

"""Under ``mpiexec -n P python -m mpi4py``: the loader's checks (``datastore.ranks.agree``) on P
real ranks, case after case; each rank writes what it saw as JSON to ``OUT.<rank>.json``.

Cases: the reduction's maximum; steps where nobody stops; a step where all stop; a step where
the last rank stops and the others go on; passes that start at different positions; ranks at
different checks; and last (a reduction that timed out is not used again) the last rank absent
from a step check while the others wait ``SHORT`` seconds.

Usage: step_check_job.py OUT
"""

from __future__ import annotations

import sys
import time
from typing import Any

from job_rows import write_row
from mpi4py import MPI

from datastore.errors import ExchangeTimeout
from datastore.ranks.agree import Collective, StepSync

TIMEOUT = 30.0  # never reached by the cases that complete, even on a loaded machine
SHORT = 2.0  # the absent rank's case


def outcome(fn: Any) -> dict[str, Any]:
    """What ``fn()`` returned, or the error it raised (type, text, peers), and its seconds."""
    t0 = time.monotonic()
    try:
        value = fn()
        got: dict[str, Any] = {"value": value.tolist() if hasattr(value, "tolist") else value}
    except Exception as exc:  # every case's error is the result
        got = {"error": type(exc).__name__, "text": str(exc)}
        if isinstance(exc, ExchangeTimeout):
            got["peers"], got["step"] = list(exc.peers), exc.step
    got["seconds"] = time.monotonic() - t0
    return got


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size, last = world.Get_rank(), world.Get_size(), world.Get_size() - 1
    coll = Collective(world)
    sync = StepSync(coll, TIMEOUT)
    out: dict[str, Any] = {"rank": rank, "size": size}
    out["max"] = outcome(lambda: coll.allreduce_max([rank, -rank, 7], TIMEOUT, "a test"))
    sync.start(0, 0)
    out["go_on"] = [outcome(lambda s=s: sync.halt(s, False)) for s in range(5)]
    out["all_stop"] = outcome(lambda: sync.halt(5, True))
    sync.start(1, 0)
    out["one_stops"] = outcome(lambda: sync.halt(0, rank == last))
    out["start_differs"] = outcome(lambda: sync.start(2 + (rank == 0), 0))
    if rank == 0:
        out["other_checks"] = outcome(lambda: sync.start(4, 0))
    else:
        out["other_checks"] = outcome(lambda: sync.halt(1, False))
    world.Barrier()
    short = StepSync(Collective(world), SHORT)
    if rank == last:  # absent: alive, in no check, until the others gave up
        time.sleep(SHORT + 3.0)
    else:
        out["absent"] = outcome(lambda: short.halt(0, False))
    write_row(sys.argv[1], rank, out)


if __name__ == "__main__":
    main()

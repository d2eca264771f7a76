"""Under ``mpiexec -n K python -m mpi4py``: several refused ``trainer`` command lines, one after
another in the same ranks (one launch instead of one per case; each case's torch import and MPI
start-up would cost more than its check).

Usage: refusals_job.py CASES OUT, CASES a JSON file: a list of command lines for
``trainer.__main__.main`` (``["train", "--set", "k=v", ...]``); each rank writes
``OUT.<rank>.json``: per case its exit code, what it wrote on stderr, and its seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

from mpi4py import MPI

from trainer.__main__ import main

if __name__ == "__main__":
    cases, out = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
    results = []
    for argv in cases:
        err, t0 = io.StringIO(), time.monotonic()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        results.append({"code": code, "stderr": err.getvalue(), "seconds": time.monotonic() - t0})
    Path(f"{out}.{MPI.COMM_WORLD.Get_rank()}.json").write_text(json.dumps(results))

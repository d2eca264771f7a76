"""What the MPI trap tests share: their data and one ``mpiexec -n 2`` launch of a job over
cases (``tests/mpi_jobs/traps_job.py``, ``traps_epochs_job.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
from helpers import MPIEXEC

JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "traps_job.py")
EPOCHS_JOB = os.path.join(os.path.dirname(__file__), "mpi_jobs", "traps_epochs_job.py")
N, D = 16, 8


def write_data(tmp: Path) -> list[str]:
    """``a.h5`` (N samples) and ``b.h5`` (N + 4): random ``x`` volumes (D voxels wide) and
    ``idx``; ``c.h5``: N samples 2 voxels wide."""
    rng = np.random.default_rng(5)
    paths = []
    for name, n, d in (("a.h5", N, D), ("b.h5", N + 4, D), ("c.h5", N, 2)):
        with h5py.File(tmp / name, "w") as f:
            f["x"] = rng.standard_normal((n, 1, d, d, d), dtype=np.float32)
            f["idx"] = np.arange(n, dtype=np.int64)
        paths.append(str(tmp / name))
    return paths


class Job:
    """One ``mpiexec -n 2`` run of ``job`` over ``cases``, one after the other in the same
    ranks (a launch per case cost about 5 s each, mostly ``import torch`` on every rank)."""

    def __init__(self, cases: list[str], *paths: str, job: str = JOB) -> None:
        out = os.path.dirname(paths[0])
        cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", job, ",".join(cases), out]
        proc = subprocess.run(
            [*cmd, *paths], capture_output=True, text=True, timeout=60 + 10 * len(cases)
        )  # a hang fails here
        assert proc.returncode == 0, proc.stderr[-3000:]
        self.cases = {case: Case(case, out, proc.stderr.splitlines()) for case in cases}

    def __getitem__(self, case: str) -> Case:
        return self.cases[case]


class Case:
    """One case of a :class:`Job`: each rank's JSON row, and the stderr lines tagged with it."""

    def __init__(self, case: str, out: str, stderr: list[str]) -> None:
        self.rows = []
        for rank in range(2):
            with open(os.path.join(out, f"{case}.{rank}.json")) as f:
                self.rows.append(json.load(f))
        self.stderr = {r: [ln for ln in stderr if ln.startswith(f"[{r}:{case}]")] for r in (0, 1)}
        self.case = case

    def raised(self, rank: int, line: str) -> bool:
        """Whether ``rank``'s stderr shows a traceback ending in ``line``."""
        return any(ln.startswith(f"[{rank}:{self.case}] {line}") for ln in self.stderr[rank])


def alone(case: str, *paths: str, job: str = JOB) -> Case:
    """A launch of ``case`` alone (one that leaves a rank waiting, or times out)."""
    return Job([case], *paths, job=job)[case]

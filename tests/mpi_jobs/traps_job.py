"""Run under ``mpiexec -n 2 python -m mpi4py``: ranks that disagree or stop early (issue 11,
traps 6, 9, 10). Each rank writes one JSON file: its error (type, message, whether it is a
``TimeoutError``, the step and peers of an ``ExchangeTimeout``), the sample indices of the
batches it took, how many of them held other bytes than the file, and timings. A rank that
raises also prints the traceback to its stderr, each line tagged ``[RANK:CASE]`` (any
launcher). Several cases (comma-separated) run one after the other in one launch: the
refusals, each raised on every rank alike, leave the ranks ready for the next.

Usage: traps_job.py CASE[,CASE...] DIR A B C  (writes DIR/CASE.RANK.json; A the dataset,
B one of other length for ``dataset``, C one of 2-voxel volumes for ``one_bad_geometry``)
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import h5py
import numpy as np
from job_rows import write_row
from mpi4py import MPI

from datastore import DataStoreLoader


def build(case: str, path: str, others: list[str], rank: int) -> DataStoreLoader:
    kw = {"global_batch_size": 4, "seed": 1, "timeout": 5}
    if case == "seed":
        kw["seed"] = rank  # the classic slip
    elif case == "batch":
        kw = {**kw, "global_batch_size": None, "batch_size": 2 + rank}
    elif case == "spatial":
        kw["spatial"] = {"parts": (2, 1, 1), "halo": rank}
    elif case == "fields":
        kw["fields"] = ["x", "idx"] if rank == 0 else ["idx"]
    elif case == "dataset":
        path = path if rank == 0 else others[0]
    elif case == "halo":
        kw["spatial"] = {"parts": (2, 1, 1), "halo": 5}  # wider than a block of 4
    elif case == "halo_axis":
        kw["spatial"] = {"parts": (4, 1, 1), "halo": (3, 1, 1)}  # blocks of 2 along axis 0
    elif case == "one_bad":
        kw["prefetch"] = 2 if rank == 0 else 0
    elif case == "one_bad_geometry":  # same arguments; rank 1's volumes are 2 voxels wide
        kw["spatial"] = {"parts": (2, 1, 1), "halo": 2}
        path = path if rank == 0 else others[1]
    elif case == "parts_world":  # 3 blocks on 2 ranks, on every rank
        kw["spatial"] = {"parts": (3, 1, 1), "halo": 1}
    elif case == "one_bad_parts":  # rank 1 alone asks for 3 blocks (2 ranks cannot hold them)
        kw["spatial"] = {"parts": (2 if rank == 0 else 3, 1, 1), "halo": 1}
    elif case == "silent":
        kw["timeout"] = 3
    elif case == "stop":  # 8 steps: more than prefetch keeps ahead, so rank 0 sees the stop
        kw["global_batch_size"] = 2
    elif case == "stall":  # 8 steps: more than the 3 that prefetch keeps ahead
        kw = {**kw, "global_batch_size": 2, "timeout": 3}
    return DataStoreLoader(path, **kw)


def main() -> None:
    cases, out_dir, path, *others = sys.argv[1:]
    rank = MPI.COMM_WORLD.Get_rank()
    with h5py.File(path, "r") as f:
        x_all = f["x"][...]
    for case in cases.split(","):
        run(case, os.path.join(out_dir, case), path, others, rank, x_all)


def run(case: str, out_prefix: str, path: str, others: list[str], rank: int, x_all) -> None:
    """One case on this rank; its row written to ``OUT_PREFIX.RANK.json``."""
    out: dict = {"rank": rank, "error": None, "ids": [], "bad_bytes": 0, "seconds": None}

    def take(b: dict) -> None:
        ids = b["idx"].tolist()
        out["ids"].append(ids)
        if "x" in b and not np.array_equal(b["x"].numpy(), x_all[ids]):
            out["bad_bytes"] += 1

    t0 = time.monotonic()
    try:
        loader = build(case, path, others, rank)
        t0 = time.monotonic()
        if case == "stop":  # rank 1 stops after one batch; rank 0 goes on
            for i, b in enumerate(loader):
                take(b)
                if rank == 1 and i == 0:
                    break
        elif case == "both_stop":  # both stop after two batches, then take a whole epoch
            for i, b in enumerate(loader):
                if i == 2:
                    break
                take(b)
            loader.set_epoch(1)
            for b in loader:
                take(b)
        elif case == "silent":  # rank 1 never iterates: it sleeps until rank 0 is done (<= 30 s)
            if rank == 1:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not os.path.exists(f"{out_prefix}.0.json"):
                    time.sleep(0.1)
            else:
                for b in loader:
                    take(b)
        elif case == "stall":  # rank 1 takes one batch, then holds the loop without a next()
            for b in loader:
                take(b)
                if rank == 1:
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline and not os.path.exists(
                        f"{out_prefix}.0.json"
                    ):
                        time.sleep(0.1)
                    break
        else:
            for b in loader:
                take(b)
    except Exception as exc:  # what each rank raised, for the test to compare
        out["error"] = [type(exc).__name__, str(exc)]
        out["timeout_error"] = isinstance(exc, TimeoutError)
        out["step"] = getattr(exc, "step", None)
        out["peers"] = list(getattr(exc, "peers", ()))
        tagged = (f"[{rank}:{case}] {line}\n" for line in traceback.format_exc().splitlines())
        sys.stderr.write("".join(tagged))  # one write: the ranks share a pipe, and a line
        sys.stderr.flush()  # written in pieces (print's text, then its newline) can be split
    out["seconds"] = time.monotonic() - t0
    write_row(out_prefix, rank, out)


if __name__ == "__main__":
    main()

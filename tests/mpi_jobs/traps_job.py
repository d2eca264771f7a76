"""Run under ``mpiexec -n 2 python -m mpi4py``: ranks that disagree or stop early (issue 11,
traps 6, 9, 10). Each rank writes one JSON file: its error (type and message) or what it saw.

Usage: traps_job.py CASE OUT DATASET [OTHER_DATASET]  (writes OUT.RANK.json)
"""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from datastore import DataStoreLoader


def build(case: str, path: str, other: str, rank: int) -> DataStoreLoader:
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
        path = path if rank == 0 else other
    elif case == "halo":
        kw["spatial"] = {"parts": (2, 1, 1), "halo": 5}  # wider than a block of 4
    elif case == "one_bad":
        kw["prefetch"] = 2 if rank == 0 else 0
    return DataStoreLoader(path, **kw)


def main() -> None:
    case, out_prefix, path = sys.argv[1:4]
    other = sys.argv[4] if len(sys.argv) > 4 else path
    rank = MPI.COMM_WORLD.Get_rank()
    out: dict = {"rank": rank, "error": None, "ids": []}
    try:
        loader = build(case, path, other, rank)
        if case == "stop":  # rank 1 stops after one batch; rank 0 goes on
            for i, b in enumerate(loader):
                out["ids"].append(b["idx"].tolist())
                if rank == 1 and i == 0:
                    break
        elif case == "both_stop":  # both stop after two batches, then take a whole epoch
            for i, b in enumerate(loader):
                if i == 2:
                    break
                out["ids"].append(b["idx"].tolist())
            loader.set_epoch(1)
            out["ids"] += [b["idx"].tolist() for b in loader]
        else:
            out["ids"] = [b["idx"].tolist() for b in loader]
    except Exception as exc:  # what each rank raised, for the test to compare
        out["error"] = [type(exc).__name__, str(exc)]
    with open(f"{out_prefix}.{rank}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()

"""One rank of a two-rank job without MPI, under torchrun or a launcher that sets only
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Loaders with ``seed=rank`` (which
every rank must refuse) and ``seed=7``: made before the process group and tried before it
exists and after (``before``, ``late``), then made after it (``after``). Writes
``OUT.RANK.json``: per loader and try, the sample ids of one epoch, or the error and whether it
came when the loader was made or iterated.

Usage: seed_agree_job.py DATASET OUT
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch.distributed as dist

from datastore import DataStoreLoader


def make(path: str, seed: int) -> tuple[DataStoreLoader | None, dict | None]:
    try:
        return DataStoreLoader(path, 4, seed=seed, timeout=20), None
    except Exception as exc:
        return None, {"error": [type(exc).__name__, str(exc)], "at": "made"}


def epoch(loader: DataStoreLoader) -> dict:
    try:
        return {"ids": [b["idx"].tolist() for b in loader], "error": None}
    except Exception as exc:
        return {"error": [type(exc).__name__, str(exc)], "at": "iter"}


def main() -> None:
    path, out = sys.argv[1:3]
    rank = int(os.environ["RANK"])
    warnings.simplefilter("ignore")  # the note that each rank reads its share itself
    rows: dict = {}
    early = {name: make(path, seed) for name, seed in (("rank", rank), ("same", 7))}
    for when in ("before", "late"):
        if when == "late":
            dist.init_process_group("gloo")
        for name, (loader, refused) in early.items():
            rows[f"{when}/{name}"] = refused or epoch(loader)
    for name, seed in (("rank", rank), ("same", 7)):
        loader, refused = make(path, seed)
        rows[f"after/{name}"] = refused or epoch(loader)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

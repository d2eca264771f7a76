"""One rank of a two-rank job without MPI whose loaders may be made before the process group.
Makes a loader with ``seed=rank`` (which every rank must refuse) and one with ``seed=7``, makes
the process group (``before``) or not (``never``), or makes it first (``after``); takes one
epoch of each and writes ``OUT.RANK.json``: per loader, the sample ids it got, or its error.

Usage: seed_agree_job.py DATASET OUT before|after|never
"""

from __future__ import annotations

import json
import sys
import warnings

import torch.distributed as dist

from datastore import DataStoreLoader


def attempt(make, rows: dict, name: str, loaders: dict) -> None:
    try:
        loaders[name] = make()
    except Exception as exc:
        rows[name] = {"error": [type(exc).__name__, str(exc)], "at": "made"}


def main() -> None:
    path, out, when = sys.argv[1:4]
    if when == "after":
        dist.init_process_group("gloo")
    rank = int(__import__("os").environ["RANK"])
    rows: dict = {}
    loaders: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that each rank reads its share itself
        for name, seed in (("rank", rank), ("same", 7)):
            attempt(
                lambda s=seed: DataStoreLoader(path, 4, seed=s, timeout=20), rows, name, loaders
            )
    if when == "before":
        dist.init_process_group("gloo")
    for name, loader in loaders.items():
        try:
            rows[name] = {"ids": [b["idx"].tolist() for b in loader], "error": None}
        except Exception as exc:
            rows[name] = {"error": [type(exc).__name__, str(exc)], "at": "iter"}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(rows, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

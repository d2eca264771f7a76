"""One rank of a torchrun-style job (no MPI) that trains as CPU DDP does: a training and a
validation loader iterated side by side (both prefetch threads exchanging at once), and the
training thread's own all-reduces on the default gloo group. Checks every batch's bytes
against the dataset and writes ``OUT.rank.json``.

Usage: torch_train_job.py DATASET OUT EPOCHS
"""

from __future__ import annotations

import faulthandler
import json
import sys

import h5py
import numpy as np
import torch
import torch.distributed as dist

from datastore import DataStoreLoader


def main() -> None:
    path, out, epochs = sys.argv[1:4]
    faulthandler.dump_traceback_later(40, exit=True)  # a hang shows where, then fails the test
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with h5py.File(path, "r") as f:
        x = f["x"][...]
    train = DataStoreLoader(path, global_batch_size=4, seed=1, timeout=10)
    val = DataStoreLoader(path, global_batch_size=4, seed=2, timeout=10)
    groups = [train._coll.group, val._coll.group]
    own_groups = dist.group.WORLD not in groups and groups[0] is not groups[1]
    result = {"batches": 0, "wrong_bytes": 0, "wrong_sums": 0, "error": None}
    try:
        for _ in range(int(epochs)):
            for pair in zip(train, val, strict=True):
                for batch in pair:
                    ok = np.array_equal(batch["x"].numpy(), x[batch["idx"].numpy()])
                    result["wrong_bytes"] += int(not ok)
                    result["batches"] += 1
                for _ in range(3):  # gradients and metrics
                    t = torch.full((4096,), float(rank + 1))
                    dist.all_reduce(t)
                    result["wrong_sums"] += int(not torch.all(t == world * (world + 1) / 2))
    except Exception as exc:  # the test shows what a rank raised
        result["error"] = f"{type(exc).__name__}: {exc}"
    source = train.source
    train.close()
    val.close()
    pgs = dist.distributed_c10d._world.pg_map
    destroyed = train._coll is None and all(g not in pgs for g in groups)
    result.update(source=source, own_groups=own_groups, destroyed=destroyed)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()

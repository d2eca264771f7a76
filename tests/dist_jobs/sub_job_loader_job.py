"""One rank of a 4-rank torchrun-style job (no MPI) that is 2-way model parallel: ranks 2k and
2k+1 are data rank k of 2 and must get the same batches, as ``DistributedSampler(num_replicas=2,
rank=k)`` gives them. The loader is told so two ways: ``rank=k, world=2`` (a job of its own
inside the default group) and ``ExchangeOptions(group=<data-parallel group>)``, that twice (a
loader over the group, closed, then another); and once with ranks numbered otherwise than the
group numbers them (refused). Writes ``OUT.RANK.json``:
per way, the loader's source, rank and world and the sample ids of one epoch, or the error.

Usage: sub_job_loader_job.py DATASET OUT
"""

from __future__ import annotations

import json
import sys
import warnings

import torch.distributed as dist

from datastore import DataStoreLoader, ExchangeOptions


def main() -> None:
    path, out = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the data-parallel groups
    dp = ExchangeOptions(group=groups[rank % 2])
    ways = {
        "given": {"rank": rank // 2, "world": world // 2},
        "group": {"exchange": dp},
        "group-again": {"exchange": dp},
        "misnumbered": {"rank": (rank + 1) % world, "world": world},
    }
    rows = {}
    for name, kw in ways.items():
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loader = DataStoreLoader(path, batch_size=2, seed=3, timeout=20, **kw)
            ids = [b["idx"].tolist() for b in loader]
            rows[name] = {
                "source": loader.source,
                "rank": loader.world.rank,
                "world": loader.world.size,
                "ids": ids,
                "warnings": [str(w.message) for w in caught],
            }
            loader.close()
        except Exception as exc:  # the test reads what the rank raised
            rows[name] = {"error": [type(exc).__name__, str(exc)]}
        dist.barrier()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

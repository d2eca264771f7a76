"""One rank of a 2-rank conformance job: the scenarios through torch's DataLoader with a
DistributedSampler (StatefulDataLoader for state) and through DataStoreLoader, over the same
files; each rank writes what it saw to ``OUT.MODE.RANK.json`` for the test to compare.

Usage: rank_job.py MODE OUT DATA TAIL
  MODE ``torchrun``: the process group is made first, then the loaders (torch.distributed
  exchange); ``mpi``: under mpiexec (MPI exchange). ``mpi-resume``: a new process loads the
  states the first run saved (``OUT.RANK.pt``); ``torchrun-late-resume``: the same with ours
  made before the process group, and a few passes of one more made so.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from conformance.common import epoch, ids_of, ours, theirs

B = 8  # per rank


def passes(loader: Any, sampler: Any = None) -> dict[str, Any]:
    """A pass after none, after a peek, after a whole pass; a pass after a break; passes
    after set_epoch(0), (1), (0) (the sampler's, for torch)."""
    got: dict[str, Any] = {"fresh": [epoch(loader)]}
    next(iter(loader))
    got["fresh"].append(epoch(loader))
    got["fresh"].append(epoch(loader))
    for i, _ in enumerate(loader):
        if i == 1:
            break
    got["after_break"] = epoch(loader)
    target = sampler if sampler is not None else loader
    got["set_epoch"] = []
    for e in (0, 1, 0):
        target.set_epoch(e)
        got["set_epoch"].append(epoch(loader))
    return got


def tails(path: str, rank: int, world: int) -> dict[str, Any]:
    """``len`` and one pass each way of drop_last, on a dataset that does not divide."""
    got: dict[str, Any] = {}
    for drop in (True, False):
        t = theirs(path, B, drop_last=drop, ranks=(rank, world))
        o = ours(path, B, drop_last=drop)
        batches = list(o)
        got[f"drop_{drop}"] = {
            "len": [len(t), len(o)],
            "torch": epoch(t),
            "ours": [ids_of(b) for b in batches],
            "valid": [b["valid"].tolist() for b in batches] if not drop else None,
        }
        o.close()
    return got


def two_iterators(loader: Any) -> dict[str, Any]:
    """Two iterators alive at once: the second's first batch, and what the first gives."""
    one = iter(loader)
    head = [ids_of(next(one))]
    two = iter(loader)
    try:
        second: Any = epoch(two)
    except RuntimeError as exc:
        second = str(exc)
    del two
    return {"first": head + epoch(one), "second": second}


def states(path: str, rank: int, world: int, out: str) -> dict[str, Any]:
    """Two uninterrupted passes, with the states at step 0, after 2 batches and after the
    first epoch saved on the way (for the resuming process)."""
    got, saved = {}, {}
    for kind in ("ours", "torch"):
        if kind == "ours":
            loader: Any = ours(path, B)
        else:
            loader = theirs(path, B, ranks=(rank, world), stateful=True)
        saved[f"{kind}-0"] = loader.state_dict()
        first = []
        for i, batch in enumerate(loader):
            first.append(ids_of(batch))
            if i == 1:
                saved[f"{kind}-mid"] = loader.state_dict()
        saved[f"{kind}-end"] = loader.state_dict()
        got[kind] = [first, epoch(loader)]
        if kind == "ours":
            loader.close()
    torch.save(saved, f"{out}.{rank}.pt")
    return got


def resume(path: str, rank: int, world: int, out: str, mine: Any) -> dict[str, Any]:
    """Each saved state loaded into a fresh loader (ours: ``mine``, made earlier, loads them
    one after the other), two passes."""
    got = {}
    for name, state in torch.load(f"{out}.{rank}.pt", weights_only=False).items():
        if name.startswith("ours"):
            loader = mine
        else:
            loader = theirs(path, B, ranks=(rank, world), stateful=True)
        loader.load_state_dict(state)
        got[name] = [epoch(loader), epoch(loader)]
    return got


def main() -> None:
    mode, out, path, tail = sys.argv[1:5]
    import torch.distributed as dist

    if mode.startswith("mpi"):
        from mpi4py import MPI

        rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    else:
        import os

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    late = [ours(path, B) for _ in range(2)] if mode == "torchrun-late-resume" else []
    if mode.startswith("torchrun"):
        dist.init_process_group("gloo")
    row: dict[str, Any] = {"rank": rank}
    if mode.endswith("-resume"):
        if late:  # made before the process group: a pass each way, and the resumptions
            row["source"] = late[0].source
            row["passes"] = {"ours": passes(late[0])}
        mine = late[1] if late else ours(path, B)
        row["resumed"] = resume(path, rank, world, out, mine)
        for loader in {id(x): x for x in (*late, mine)}.values():
            loader.close()
    else:
        mine = ours(path, B)
        row["source"] = mine.source
        t = theirs(path, B, ranks=(rank, world))
        row["passes"] = {"torch": passes(t, t.sampler), "ours": passes(mine)}
        row["len"] = [len(t), len(mine)]
        row["two"] = {"torch": two_iterators(t), "ours": two_iterators(mine)}
        mine.close()
        row["tails"] = tails(tail, rank, world)
        row["straight"] = states(path, rank, world, out)
    with open(f"{out}.{mode}.{rank}.json", "w") as f:
        json.dump(row, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

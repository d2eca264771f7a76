"""Two ranks as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), one (2, 1, 1) grid
with a 60 s halo timeout: DistConv3d and DistMaxPool3d over input geometries that one rank's
block makes invalid, and one valid geometry seen several times.

Usage: geometry_agree_job.py OUT  (writes OUT.RANK.json: ``{case: {"error", "agreed", ...}}``)
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

from trainer.grid import ProcessGrid, init_distributed
from trainer.layers import DistConv3d
from trainer.pool import DistMaxPool3d

# case: (layer, kernel, stride, rank 0's input shape, rank 1's input shape)
CASES = {
    "conv-k3s2-odd-block": ("conv", 3, 2, (1, 1, 5, 4, 4), (1, 1, 4, 4, 4)),
    "conv-k3s2-odd-block-h": ("conv", 3, 2, (1, 1, 7, 6, 6), (1, 1, 7, 6, 6)),
    "conv-k5s2-short-block": ("conv", 5, 2, (1, 1, 4, 4, 4), (1, 1, 1, 4, 4)),
    "conv-k3s2-not-a-box": ("conv", 3, 2, (1, 1, 4, 4, 4), (1, 1, 4, 6, 4)),
    "conv-k3s2-batch-differs": ("conv", 3, 2, (2, 1, 4, 4, 4), (1, 1, 4, 4, 4)),
    "pool-k2s2-odd-block": ("pool", 2, 2, (1, 1, 3, 4, 4), (1, 1, 4, 4, 4)),
}
VALID = ("conv", 3, 2, (1, 1, 4, 4, 4), (1, 1, 5, 4, 4))  # the last block may be odd


def layer(kind: str, k: int, s: int, grid: ProcessGrid) -> torch.nn.Module:
    if kind == "pool":
        return DistMaxPool3d(k, grid, stride=s)
    return DistConv3d(1, 1, k, grid, stride=s, broadcast=False, overlap=False)


def main() -> None:
    out = sys.argv[1]
    rank, _ = init_distributed(timeout=datetime.timedelta(seconds=60))
    grid = ProcessGrid.create((2, 1, 1))
    got: dict[str, dict] = {}
    for name, (kind, k, s, *shapes) in CASES.items():
        m = layer(kind, k, s, grid)
        try:
            m(torch.zeros(shapes[rank]))
            got[name] = {"error": None}
        except ValueError as exc:
            got[name] = {"error": str(exc)}
        got[name]["agreed"] = len(m.agreed.shapes)
    kind, k, s, *shapes = VALID
    m = layer(kind, k, s, grid)
    outs = [tuple(m(torch.ones(shapes[rank])).shape) for _ in range(3)]
    got["valid-3-steps"] = {"error": None, "agreed": len(m.agreed.shapes), "outputs": outs}
    m(torch.ones((2, *shapes[rank][1:])))  # a new batch size: agreed once more, on both
    got["valid-new-batch"] = {"error": None, "agreed": len(m.agreed.shapes)}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(got, f)
    dist.barrier()  # none leaves while the other still sends; then leave the group cleanly
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

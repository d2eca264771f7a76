"""Under ``mpiexec -n 2 python -m mpi4py``: a checkpoint's whole state of a split first dense
layer (``trainer.dense``), 2 uneven blocks, assembled on the spatial group's first rank alone.

The layer's weight and SGD's momentum after one step are gathered by ``whole_model_state`` and
``whole_optimizer_state``; the reference is every rank's columns all-gathered and placed by
``block_columns`` (what every rank assembled before). Rank 0 writes every rank's row as JSON:
``{"model": ..., "optimizer": ...}``, each ``"none"`` where the function returned ``None``,
else whether the whole tensors equal the reference exactly.

Usage: whole_state_job.py OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from trainer.dense import DistFlattenLinear, whole_model_state, whole_optimizer_state
from trainer.grid import ProcessGrid, init_distributed

CHANNELS, WHOLE, OUT = 2, (3, 2, 2), 3  # blocks of 2 and 1 along the first axis


def assembled(layer: DistFlattenLinear, t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which every rank holds its columns ``t``, from an all-gather."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (layer.columns(layer.grid.spatial_rank), t.detach().clone()))
    whole = torch.full((OUT, layer.in_features), float("nan"))
    for cols, piece in every:
        whole[:, cols] = piece
    return whole


def verdict(state: dict | None, key, want: torch.Tensor) -> str | bool:
    if state is None:
        return "none"
    got = key(state)
    return got.dtype == want.dtype and torch.equal(got, want)


def main() -> None:
    init_distributed()
    grid = ProcessGrid.create((2, 1, 1))
    torch.manual_seed(0)
    model = nn.Sequential(DistFlattenLinear(CHANNELS, WHOLE, OUT, grid))
    layer = model[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn((2, CHANNELS, *layer.expected[grid.spatial_rank]))
    model(x).square().sum().backward()
    opt.step()
    momentum = assembled(layer, opt.state[layer.weight]["momentum_buffer"])
    weight = assembled(layer, layer.weight)
    row = {
        "model": verdict(whole_model_state(model), lambda s: s["0.weight"], weight),
        "optimizer": verdict(
            whole_optimizer_state(model, opt), lambda s: s["state"][0]["momentum_buffer"], momentum
        ),
    }
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(rows, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

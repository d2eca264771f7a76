"""Under ``mpiexec -n 2 python -m mpi4py``: the trainer's parallel costs (see
``benchmarks/train_step.py``).

1. Saved activations of one CosmoFlow forward on a whole sample (``TorchLayers``) vs this rank's
   half (``DistLayers``, parts (2, 1, 1)): bytes of every tensor autograd saves
   (``torch.autograd.graph.saved_tensors_hooks``), counted once per storage.
2. Halo exchange share: training steps of the split model; the time spent in the halo
   exchange's forward and backward (``trainer.halo._forward`` / ``_adjoint`` wrapped with
   timers) over the step time, the slowest rank.
3. Lion Cub: 2 data ranks, ``opt.comm`` after a few steps on the model's parameters, for the
   ``int8`` and ``packed`` modes.

Rank 0 writes JSON to OUT. Usage: train_step_job.py OUT SIDE WIDTH BATCH STEPS
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import trainer.halo as halo
from datastore.maths.partition import Grid, block_bounds
from trainer.dist_models import DistLayers
from trainer.grid import ProcessGrid, init_distributed
from trainer.lion_cub import LionCub
from trainer.models import CosmoFlow, TorchLayers
from trainer.reduce import GradientReducer

_seconds = {"halo": 0.0}

BLOCKS = 4  # CosmoFlow conv blocks (poolings), here and in train_step.py


def _timed(fn: Any) -> Any:
    def wrapper(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            _seconds["halo"] += time.perf_counter() - t0

    return wrapper


def saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(seen.values())


def cosmoflow(side: int, width: int, layers: Any) -> CosmoFlow:
    torch.manual_seed(0)
    return CosmoFlow(4, 3, input_size=side, conv_size=width, n_conv=BLOCKS, layers=layers)


def slowest(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    out, side, width, batch, steps = sys.argv[1], *map(int, sys.argv[2:])
    init_distributed()
    split = ProcessGrid.create((2, 1, 1))
    data = ProcessGrid.create((1, 1, 1))
    x = torch.randn(batch, 4, side, side, side, generator=torch.Generator().manual_seed(1))
    y = torch.rand(batch, 3) * 2 - 1
    own = block_bounds(Grid((side,) * 3, split.parts), split.spatial_rank)
    xb = x[(..., *own)].contiguous()
    layers = DistLayers(split, split.spatial_group, overlap=False)  # timed in _forward/_adjoint
    model = cosmoflow(side, width, layers)
    whole = saved_bytes(cosmoflow(side, width, TorchLayers()), x)
    part = saved_bytes(model, xb)
    result: dict[str, Any] = {
        "activations": {"whole": whole, "split": slowest(part), "ratio": slowest(part) / whole}
    }

    halo._forward, halo._adjoint = _timed(halo._forward), _timed(halo._adjoint)
    reducer = GradientReducer(model, split, spatially_partial=layers.spatially_partial())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, halos = [], []
    for _ in range(steps + 1):  # the first is a warm-up
        dist.barrier()
        _seconds["halo"] = 0.0
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), y).backward()
        reducer.finish()
        opt.step()
        times.append(time.perf_counter() - t0)
        halos.append(_seconds["halo"])
    step = slowest(statistics.median(times[1:]))
    halo_s = slowest(statistics.median(halos[1:]))
    result["halo"] = {"step_s": step, "halo_s": halo_s, "share": halo_s / step}

    params = [p.detach().clone() for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    result["lion_cub"] = {}
    for mode in ("int8", "packed"):
        opt = LionCub(params, data, lr=1e-4, mode=mode, momentum_sync_every=0)
        for s in range(5):
            g = torch.Generator().manual_seed(100 * data.data_rank + s)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        c = opt.comm
        result["lion_cub"][mode] = {
            "params": sum(p.numel() for p in params), "steps": c.steps,
            "bytes_sent": c.bytes_sent, "bytes_fp32": c.bytes_fp32,
            "bytes_saved": c.bytes_saved, "ratio": c.ratio,
        }  # fmt: skip
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Under ``mpiexec -n W python -m mpi4py`` (or one plain process): training steps of CosmoFlow
on this rank's block, for ``benchmarks/train_gpu.py``.

Every rank builds CosmoFlow (``width`` filters, 4 blocks or fewer for small sides) over a
``W / prod(parts)`` data x ``parts`` grid, on ``DEVICE`` (every rank on GPU 0 over gloo, each
limited to ``1 / W`` of its memory with ``torch.cuda.set_per_process_memory_fraction``), takes a
random batch block resident on the device and runs ``STEPS`` SGD steps after one warm-up.
Measured per step (the slowest rank): seconds (the device synchronized), host seconds blocked
in the halo waits (``trainer.halo.wait_clock``), host seconds in ``GradientReducer.finish()``
(the all-reduce not hidden behind backward), and the peak memory: on CUDA
``torch.cuda.max_memory_allocated``, on the CPU the bytes autograd saves in one forward.
A CUDA out-of-memory error is reported as ``"oom": true``.

Rank 0 writes JSON to OUT. Usage::

    train_gpu_job.py OUT SIDE WIDTH BATCH STEPS DEVICE PARTS HALO_OVERLAP REDUCE_OVERLAP

with PARTS as ``2,1,1`` and the overlaps as ``0``/``1``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from train_step_job import saved_bytes  # the same measure as the CPU step benchmark

from datastore.partition import Grid, block_bounds
from trainer.comm import all_reduce_sum
from trainer.dist_models import DistLayers
from trainer.grid import ProcessGrid, init_distributed
from trainer.halo import wait_clock
from trainer.models import CosmoFlow
from trainer.reduce import GradientReducer


def slowest(v: float, grid: ProcessGrid) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(a: dict[str, Any], grid: ProcessGrid, device: torch.device) -> dict[str, Any]:
    side, batch = a["side"], a["batch"]
    n_conv = min(4, int(math.log2(side // max(grid.parts))))
    layers = DistLayers(grid, grid.spatial_group, overlap=a["halo_overlap"])
    torch.manual_seed(0)
    model = CosmoFlow(4, 4, input_size=side, conv_size=a["width"], n_conv=n_conv, layers=layers)
    fmt = torch.channels_last_3d if device.type == "cuda" else torch.contiguous_format
    model = model.to(device, memory_format=fmt)
    own = block_bounds(Grid((side,) * 3, grid.parts), grid.spatial_rank)
    shape = (batch, 4, *(s.stop - s.start for s in own))
    x = torch.randn(shape, device=device).contiguous(memory_format=fmt)
    y = torch.rand(batch, 4, device=device) * 2 - 1
    reducer = GradientReducer(
        model, grid, spatially_partial=layers.spatially_partial(), overlap=a["reduce_overlap"]
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    amp = device.type == "cuda"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, halos, reduces = [], [], []
    for _ in range(a["steps"] + 1):  # the first is a warm-up
        all_reduce_sum(torch.zeros(1), None, grid.timeout)  # start together
        sync(device)
        wait_clock.reset()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        sync(device)
        t1 = time.perf_counter()
        reducer.finish()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        halos.append(wait_clock.forward_s + wait_clock.backward_s)
        reduces.append(t2 - t1)
    step = slowest(statistics.median(times[1:]), grid)
    out: dict[str, Any] = {
        "step_s": step, "samples_per_s": batch * grid.data_size / step,
        "halo_s": slowest(statistics.median(halos[1:]), grid),
        "reduce_s": slowest(statistics.median(reduces[1:]), grid), "oom": False,
    }  # fmt: skip
    out["halo_share"], out["reduce_share"] = out["halo_s"] / step, out["reduce_s"] / step
    if device.type == "cuda":
        out["peak_bytes"] = slowest(torch.cuda.max_memory_allocated(device), grid)
    else:
        out["peak_bytes"] = slowest(saved_bytes(model, x), grid)
    reducer.remove()
    return out


def main() -> None:
    out_path = sys.argv[1]
    side, width, batch, steps = map(int, sys.argv[2:6])
    device = torch.device(sys.argv[6])
    parts = tuple(int(p) for p in sys.argv[7].split(","))
    a = dict(side=side, width=width, batch=batch, steps=steps,
             halo_overlap=sys.argv[8] == "1", reduce_overlap=sys.argv[9] == "1")  # fmt: skip
    _, world = init_distributed()  # gloo: ranks share the GPU through host memory
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        torch.cuda.set_per_process_memory_fraction(1.0 / world, device)
    grid = ProcessGrid.create(parts)
    try:
        result = run(a, grid, device)
    except torch.OutOfMemoryError:
        result = {"oom": True}
    flags = torch.tensor([float(result["oom"])])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags.item():
        result = {"oom": True}
    result.update(world=world, parts=list(parts), side=side, batch=batch)
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Under ``mpiexec -n W python -m mpi4py`` (or one plain process): training steps of CosmoFlow
on this rank's block, for ``benchmarks/train_gpu.py``.

Every rank builds CosmoFlow (``--width`` filters, 4 blocks or fewer for small sides) over a
``W / prod(parts)`` data x ``--parts`` grid, takes a random batch block resident on its device
and runs ``--steps`` SGD steps after one warm-up. Backends:

- ``gloo``: every rank on GPU 0 (or the CPU), each limited to ``1 / W`` of the GPU's memory
  (``torch.cuda.set_per_process_memory_fraction``); CUDA tensors travel staged through pinned
  host memory. What one GPU can run with several ranks.
- ``nccl``: one GPU per rank (``cuda:(local rank % GPUs)``; a cluster), NCCL's own timing on
  (``TORCH_NCCL_ENABLE_TIMING=1``). At world 1 (one GPU) the step communicates nothing (no
  halo without a split, no all-reduce with one replica; the halo code has no periodic wrap, so
  a rank cannot be its own neighbour): ``--probe`` then times the NCCL path directly, below.

Measured per step, the median over the steps, the slowest rank: the step in host seconds
(the device synchronized after it, never inside: a synchronization would finish NCCL's
transfers before the waits the clock times) and, on a GPU, in device seconds (CUDA events on
the compute stream around the step); the host seconds blocked in halo waits
(``trainer.halo.wait_clock``) and in ``GradientReducer.finish()``; and
``trainer.comm.comm_clock`` by operation (``exchange``: the halo; ``all_reduce``: gradients and
the layers' sums): host seconds in gloo waits, the compute stream's stall in NCCL waits and
each transfer's time on NCCL's stream, the staged copies' device time. ``--without-reduce``
also times the steps without the gradient all-reduce (``step_device_without_reduce_s``, to
subtract). Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the timed steps (not
the warm-up, whose ``cudnn.benchmark`` tries algorithms in transient workspaces), on the CPU
the bytes autograd saves in one forward plus those a rank keeps between steps (parameters,
gradients, optimizer state, the reducer's buckets). A CUDA out-of-memory error is reported as
``"oom": true``.

``--probe`` (world 1, NCCL): the gradients' all-reduce and the first convolution's halo slab
sent by the rank to itself (``start_exchange``'s NCCL branch), each either started before a
forward and backward and waited after it (overlapped) or waited at once; the stall and NCCL's
time per operation.

Rank 0 writes JSON to OUT. Usage::

    train_gpu_job.py OUT --side 128 --width 32 --steps 10 --device cuda --parts 2,1,1 \\
        [--backend gloo|nccl] [--halo-overlap] [--reduce-overlap] [--without-reduce] [--probe]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from train_step_job import saved_bytes  # the same measure as the CPU step benchmark

from datastore.maths.partition import Grid, block_bounds
from staging.cluster import local_rank, local_size
from trainer.comm import CommTimes, all_reduce_sum, comm_clock, start_all_reduce, start_exchange
from trainer.devices import pick_device
from trainer.dist_models import DistLayers
from trainer.grid import ProcessGrid, init_distributed
from trainer.halo import wait_clock
from trainer.models import CosmoFlow
from trainer.reduce import GradientReducer

KINDS = ("exchange", "all_reduce")
FIELDS = [f.name for f in dataclasses.fields(CommTimes)]


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Every value's maximum over the ranks (one collective, on ``device`` for NCCL)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceSpan:
    """Device seconds between two CUDA events on the current stream (host seconds on the CPU,
    with the caller synchronizing)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t = [0.0, 0.0]
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def mark(self, i: int) -> None:
        if self.cuda:
            self.events[i].record()
        else:
            self.t[i] = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.t[1] - self.t[0]


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer, reducer: GradientReducer):
    """Bytes of the distinct storages a rank keeps between steps: parameters, gradients,
    optimizer state and the reducer's buckets."""
    kept = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    kept += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    kept += [b.flat for b in reducer.buckets]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return sum(storages.values())


def model_and_batch(a: argparse.Namespace, grid: ProcessGrid, device: torch.device):
    side = a.side
    n_conv = min(4, int(math.log2(side // max(grid.parts))))
    layers = DistLayers(grid, grid.spatial_group, overlap=a.halo_overlap)
    torch.manual_seed(0)
    model = CosmoFlow(4, 4, input_size=side, conv_size=a.width, n_conv=n_conv, layers=layers)
    fmt = torch.channels_last_3d if device.type == "cuda" else torch.contiguous_format
    model = model.to(device, memory_format=fmt)
    own = block_bounds(Grid((side,) * 3, grid.parts), grid.spatial_rank)
    shape = (a.batch, 4, *(s.stop - s.start for s in own))
    x = torch.randn(shape, device=device).contiguous(memory_format=fmt)
    y = torch.rand(a.batch, 4, device=device) * 2 - 1
    return model, layers, x, y


def forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda):
        out = model(x)
    torch.nn.functional.mse_loss(out.float(), y).backward()


def timed_steps(model, x, y, opt, reducer, n: int, grid: ProcessGrid, coll: torch.device):
    """Medians over ``n`` steps after a warm-up: step (host, device), halo waits, finish(),
    then the ``comm_clock`` fields of ``KINDS``. ``reducer=None``: no gradient all-reduce."""
    device = x.device
    rows: list[list[float]] = []
    for i in range(n + 1):  # the first is a warm-up
        if i == 1 and device.type == "cuda":  # the peak of the timed steps only
            torch.cuda.reset_peak_memory_stats(device)
        all_reduce_sum(torch.zeros(1, device=coll), None, grid.timeout)  # start together
        sync(device)
        wait_clock.reset()
        comm_clock.start()
        span = DeviceSpan(device)
        t0 = time.perf_counter()
        span.mark(0)
        opt.zero_grad(set_to_none=True)
        forward_backward(model, x, y)
        t1 = time.perf_counter()
        if reducer is not None:
            reducer.finish()
        t2 = time.perf_counter()
        opt.step()
        span.mark(1)
        sync(device)
        step_s = time.perf_counter() - t0
        times = comm_clock.read()
        comm_clock.stop()
        comm = [getattr(times.get(k, CommTimes()), f) for k in KINDS for f in FIELDS]
        halo = wait_clock.forward_s + wait_clock.backward_s
        rows.append([step_s, span.seconds(), halo, t2 - t1, *comm])
    return [statistics.median(col) for col in zip(*rows[1:], strict=True)]


def run(a: argparse.Namespace, grid: ProcessGrid, device: torch.device, coll: torch.device):
    model, layers, x, y = model_and_batch(a, grid, device)
    partial = layers.spatially_partial()
    reducer = GradientReducer(model, grid, spatially_partial=partial, overlap=a.reduce_overlap)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    figures = timed_steps(model, x, y, opt, reducer, a.steps, grid, coll)
    if device.type == "cuda":
        figures.append(torch.cuda.max_memory_allocated(device))
    else:
        figures.append(saved_bytes(model, x) + state_bytes(model, opt, reducer))
    reducer.remove()
    without = timed_steps(model, x, y, opt, None, a.steps, grid, coll) if a.without_reduce else []
    figures.append(without[1] if without else float("nan"))
    worst = slowest(figures, coll)
    out: dict[str, Any] = {
        "oom": False, "step_s": worst[0], "step_device_s": worst[1], "halo_s": worst[2],
        "reduce_s": worst[3], "peak_bytes": worst[-2], "step_device_without_reduce_s": worst[-1],
    }  # fmt: skip
    it = iter(worst[4:-2])
    out["comm"] = {k: {f: next(it) for f in FIELDS} for k in KINDS}
    out["samples_per_s"] = a.batch * grid.data_size / out["step_s"]
    out["halo_share"], out["reduce_share"] = out["halo_s"] / worst[0], out["reduce_s"] / worst[0]
    if a.probe:
        out["probe"] = probe(model, x, y, a.steps, grid)
    return out


def probe(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reps: int, grid: ProcessGrid
) -> dict:
    """World 1 on NCCL (module docstring): ``{op: {"overlapped"|"at_once": {stall_s,
    nccl_s, compute_s}}}``, medians of ``reps``; ``compute_s``: the forward and backward alone
    (CUDA events), to compare with."""
    grads = torch.cat([p.detach().flatten() for p in model.parameters()])
    slab = x[:, :, :1].contiguous()  # one plane of the input: the first convolution's halo
    got = torch.empty_like(slab)

    def start(op: str):
        if op == "all_reduce":
            return start_all_reduce(grads, None, grid.timeout)
        return start_exchange([(0, slab, 0)], [(0, got, 0)], None, grid.timeout)

    out: dict[str, dict] = {}
    for op in ("all_reduce", "exchange"):
        out[op] = {}
        for mode in ("overlapped", "at_once"):
            rows = []
            for _ in range(reps):
                sync(x.device)
                comm_clock.start()
                span = DeviceSpan(x.device)
                pending = start(op)
                if mode == "at_once":
                    pending.wait()
                span.mark(0)
                forward_backward(model, x, y)
                span.mark(1)
                pending.wait()
                t = comm_clock.read()[op]
                comm_clock.stop()
                nccl = t.nccl_s if t.nccl_timed else float("nan")  # nan: NCCL gave no timing
                rows.append((t.stall_s, nccl, span.seconds()))
            cols = [statistics.median(c) for c in zip(*rows, strict=True)]
            out[op][mode] = dict(zip(("stall_s", "nccl_s", "compute_s"), cols, strict=True))
    out["bytes"] = {"all_reduce": grads.nbytes, "exchange": slab.nbytes}
    if not torch.equal(got, slab):
        raise RuntimeError("probe: the slab sent to itself over NCCL arrived changed")
    return out


def start_group(a: argparse.Namespace) -> tuple[int, torch.device, torch.device]:
    """Initialize the default group; ``(world, this rank's device, collectives' device)``."""
    device = torch.device(a.device)
    if a.backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # NCCL's events on its stream
        gpus = torch.cuda.device_count()
        if local_size() > gpus:
            raise SystemExit(f"--backend nccl needs a GPU per rank: {local_size()} ranks on "
                             f"this node, {gpus} GPU(s); use --backend gloo")  # fmt: skip
        device = pick_device("cuda", gpus=gpus, local_rank=local_rank())
        _, world = init_distributed("nccl", device=device)
        return world, device, device
    _, world = init_distributed()  # gloo: ranks share the GPU through host memory
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_per_process_memory_fraction(1.0 / world, device)
    return world, device, torch.device("cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--side", type=int, required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--parts", default="1,1,1")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--halo-overlap", action="store_true")
    p.add_argument("--reduce-overlap", action="store_true")
    p.add_argument("--without-reduce", action="store_true")
    p.add_argument("--probe", action="store_true")
    a = p.parse_args()
    world, device, coll = start_group(a)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    grid = ProcessGrid.create(tuple(int(n) for n in a.parts.split(",")))
    try:
        result = run(a, grid, device, coll)
    except torch.OutOfMemoryError:
        result = {"oom": True}
    flags = torch.tensor([float(result["oom"])], device=coll)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags.item():
        result = {"oom": True}
    result.update(world=world, parts=grid.parts, side=a.side, batch=a.batch, backend=a.backend,
                  device=str(device))  # fmt: skip
    if dist.get_rank() == 0:
        with open(a.out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

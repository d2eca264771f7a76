"""``DistBatchNorm3d`` under bf16 autocast and ``DistConv3d`` built with its defaults, on real
ranks: rank 0 writes ``{rank: {case: {check: value}}}`` as JSON.

CPU (``mpiexec -n 2 python -m mpi4py``, gloo): every rank seeds its own initialization, builds a
default ``DistConv3d`` (broadcast from rank 0) and reports how far its parameters are from
rank 0's; then ``DistBatchNorm3d`` on a bf16 input under ``torch.autocast("cpu", bf16)``, split
in two along depth ("split": statistics over the spatial group, the whole sample) and whole on
each rank ("whole": a spatial group of one), against ``torch.nn.BatchNorm3d`` on the whole
sample: in float64 on the same bf16 values (exact), in float32 (running statistics) and under
the same autocast (torch's own bf16 path).

CUDA (``norm_bf16_job.py OUT_JSON cuda``, one process): NCCL on ``cuda:0``, world of one; the
same checks with ``torch.autocast("cuda", bf16)``.

Errors of bf16 outputs are in units of their rounding: ``|got - ref| / (u * |ref| + floor)``
with ``u = 2**-8`` (half a bf16 ulp: an output computed exactly and rounded once scores <= 1)
and ``floor = 1e-5 * max |ref|`` for the float32 arithmetic before the rounding.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from trainer.comm import all_gather
from trainer.grid import ProcessGrid, init_distributed
from trainer.layers import DistConv3d, sum_spatial_grads
from trainer.norm import DistBatchNorm3d

N, C, SHAPE = 2, 3, (8, 6, 6)
BF16 = torch.bfloat16
U = 2.0**-8  # unit roundoff of bf16
MEANS, STDS = (10.0, -4.0, 0.5), (3.0, 0.25, 1.0)  # far from 0: a bf16 mean would show


def rounding_units(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst ``|got - ref| / (U * |ref| + 1e-5 * max |ref|)`` (float64)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    floor = 1e-5 * float(ref.abs().max())
    return float(((got - ref).abs() / (U * ref.abs() + floor)).max())


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return float((got - ref).abs().max() / ref.abs().max())


def volume(seed: int) -> torch.Tensor:
    """The whole bf16 input (the same on every rank), per-channel means and deviations."""
    z = torch.randn((N, C, *SHAPE), generator=torch.Generator().manual_seed(seed))
    shift = torch.tensor(MEANS).view(1, C, 1, 1, 1)
    return (shift + torch.tensor(STDS).view(1, C, 1, 1, 1) * z).to(BF16)


def check_conv_defaults(device: torch.device) -> dict:
    """A ``DistConv3d`` built with every default (on the CPU, broadcast on), then moved to
    ``device`` and run under autocast."""
    grid = ProcessGrid.create((1, 1, 1))

    def built(**kw) -> tuple[DistConv3d, torch.Tensor]:
        torch.manual_seed(1000 + dist.get_rank())  # a different initialization on every rank
        layer = DistConv3d(C, C, 3, grid, **kw)
        return layer, torch.cat([p.detach().flatten() for p in layer.parameters()]).to(device)

    _, own = built(broadcast=False)
    layer, flat = built()
    every = all_gather(flat, None, grid.timeout)
    layer.to(device)
    with torch.autocast(device.type, dtype=BF16):
        out = layer(volume(1).to(device))
    return {
        "params_from_rank0": float((every[0] - flat).abs().max()),
        "own_init_from_rank0": float((every[0] - own).abs().max()),
        "out_dtype": str(out.dtype),
        "out_finite": bool(torch.isfinite(out).all()),
    }


def check_bn(parts: tuple[int, ...], device: torch.device) -> dict:
    grid = ProcessGrid.create(parts)
    v, dy = volume(2), volume(3) - torch.tensor(MEANS).view(1, C, 1, 1, 1).to(BF16)
    depth = SHAPE[0] // parts[0]  # this rank's slab of depth
    mine = (
        slice(None),
        slice(None),
        slice(grid.spatial_rank * depth, (grid.spatial_rank + 1) * depth),
    )
    x = v[mine].to(device).requires_grad_()
    g = dy[mine].to(device)
    layer = DistBatchNorm3d(C, grid, stats_group=grid.spatial_group).to(device)
    exact = nn.BatchNorm3d(C, dtype=torch.float64)
    fp32 = nn.BatchNorm3d(C).to(device)
    amp = nn.BatchNorm3d(C).to(device)
    with torch.no_grad():
        for bn in (layer, exact, fp32, amp):
            bn.weight.copy_(torch.tensor([1.5, -0.75, 2.0]))
            bn.bias.copy_(torch.tensor([0.25, 3.0, -1.0]))
    with torch.autocast(device.type, dtype=BF16):
        y = layer(x)
    y.backward(g.to(y.dtype))  # y is float32 where bf16 was promoted
    sum_spatial_grads(layer.parameters(), grid)
    v64 = v.double().requires_grad_()
    y64 = exact(v64)
    y64.backward(dy.double())
    fp32(v.float().to(device))
    with torch.autocast(device.type, dtype=BF16):
        y_amp = amp(v.to(device))
    layer.eval()
    exact.eval()
    with torch.autocast(device.type, dtype=BF16):
        y_eval = layer(x.detach())
    return {
        "out_dtype": str(y.dtype),
        "input_grad_dtype": str(x.grad.dtype),
        "eval_out_dtype": str(y_eval.dtype),
        "buffer_dtypes": sorted({str(b.dtype) for b in (layer.running_mean, layer.running_var)}),
        "torch_autocast_out_dtype": str(y_amp.dtype),
        "out_units": rounding_units(y, y64[mine]),
        "out_units_vs_torch_autocast": rounding_units(y, y_amp[mine]),
        "input_grad_units": rounding_units(x.grad, v64.grad[mine]),
        "weight_grad_rel": rel(layer.weight.grad, exact.weight.grad),
        "bias_grad_rel": rel(layer.bias.grad, exact.bias.grad),
        "running_mean_rel_fp32": rel(layer.running_mean, fp32.running_mean),
        "running_var_rel_fp32": rel(layer.running_var, fp32.running_var),
        "running_mean_rel_exact": rel(layer.running_mean, exact.running_mean),
        "running_var_rel_exact": rel(layer.running_var, exact.running_var),
        "eval_out_units": rounding_units(y_eval, exact(v.double())[mine]),
    }


def main() -> None:
    torch.set_num_threads(1)
    cuda = sys.argv[2:] == ["cuda"]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rank, world = init_distributed("nccl" if cuda else "gloo", device=device if cuda else None)
    results = {"backend": dist.get_backend(), "conv defaults": check_conv_defaults(device)}
    if world == 2:
        results["bn split"] = check_bn((2, 1, 1), device)
    results["bn whole"] = check_bn((1, 1, 1), device)
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(enumerate(every)), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

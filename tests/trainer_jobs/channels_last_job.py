"""Under ``mpiexec -n 4 python -m mpi4py``: the halo exchange (whole, and split into start and
finish) and ``DistConv3d`` (overlap on and off, stride 1 and 2) on a ``channels_last_3d`` block
against the same on the contiguous block, in float32 and float64; rank 0 writes JSON. With
DEVICE ``cuda:0`` (default ``cpu``) every rank runs on that one GPU over gloo (messages staged
through pinned host memory; NCCL refuses two ranks on one GPU), in float32 only with TF32 off:
cuDNN keeps float64 convolutions contiguous whatever the layout.

Per case and dtype: the largest absolute differences of the outputs and of every gradient
(input, weight, bias) between the two layouts and the largest absolute value of each in the
contiguous run (``*_scale``), whether the output and the input gradient are
``channels_last_3d``, and every tensor of 5 axes that an operation made in forward and backward
with its channels not innermost (a layout conversion: ``TorchDispatchMode`` sees each aten
operation's outputs).

Usage: channels_last_job.py OUT_JSON [DEVICE]   (4 ranks, or 2: one split axis at a time)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from job_results import write_results
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from datastore.maths.partition import Grid, block_bounds
from trainer.grid import ProcessGrid, init_distributed
from trainer.halo import finish_halo_exchange, halo_exchange, start_halo_exchange
from trainer.layers import DistConv3d

CL = torch.channels_last_3d
SHAPE = (8, 8, 8)
N, C_IN, C_OUT = 2, 3, 5  # no block side is 3 or 5: see Conversions
# 4 ranks: two split axes (corners travel in two hops); 2 ranks: the outer or the inner axis
PARTS = {4: [(2, 2, 1), (1, 2, 2)], 2: [(2, 1, 1), (1, 1, 2)]}
DEVICE = torch.device("cpu")  # where the blocks and layers live (argv[2])


class Conversions(TorchDispatchMode):
    """Every ``(N, C, D, H, W)`` tensor an aten operation returns with channels not innermost:
    what a ``channels_last_3d`` pipeline must never make. A tensor counts as such when its
    second axis has ``C_IN`` or ``C_OUT`` elements (no spatial side here has 3 or 5: the
    halo's message buffers, ``(N, D, H, W, C)``, are contiguous and fine)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.dim() == 5
                and t.size(1) in (C_IN, C_OUT)
                and t.stride(1) != 1
            ):
                self.seen.append(f"{func}: {tuple(t.shape)} strides {t.stride()}")
        return out


def block(pg: ProcessGrid, seed: int, channels: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn((N, channels, *SHAPE), generator=g, dtype=torch.float64).to(dtype)
    bounds = block_bounds(Grid(SHAPE, pg.parts, (0, 0, 0), "zero"), pg.spatial_rank)
    return whole[(slice(None), slice(None), *bounds)].to(DEVICE, copy=True)


def gathered(errs: dict[str, float], seen: list[str]) -> dict:
    """The worst difference over the ranks, and every rank's conversions."""
    out = {}
    for key, value in errs.items():
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[key] = float(t)
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, seen)
    out["conversions"] = [s for rank in everyone for s in rank]
    return out


def compare(
    run: Callable[[torch.Tensor], torch.Tensor],
    params: list[torch.Tensor],
    cl_run: Callable[[torch.Tensor], torch.Tensor],
    cl_params: list[torch.Tensor],
    x: torch.Tensor,
    seed: int,
) -> tuple[dict[str, float], list[str]]:
    """``run`` on contiguous ``x`` against ``cl_run`` on it in ``channels_last_3d``, backward
    from the same gradient (contiguous, resp. ``channels_last_3d`` as the next layer gives)."""
    xc = x.clone().requires_grad_()
    out = run(xc)
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
    want = torch.autograd.grad(out, [xc, *params], grad)
    xl = x.contiguous(memory_format=CL).requires_grad_()
    with Conversions() as mode:
        cl_out = cl_run(xl)
        got = torch.autograd.grad(cl_out, [xl, *cl_params], grad.contiguous(memory_format=CL))
    names = ["input_grad", "weight_grad", "bias_grad"][: len(got)]
    errs = {"output": float((cl_out - out).abs().max())}
    errs.update({n: float((a - b).abs().max()) for n, a, b in zip(names, got, want, strict=True)})
    errs["output_scale"] = float(out.abs().max())
    errs.update({f"{n}_scale": float(b.abs().max()) for n, b in zip(names, want, strict=True)})
    errs["output_not_cl"] = float(not cl_out.is_contiguous(memory_format=CL))
    errs["input_grad_not_cl"] = float(not got[0].is_contiguous(memory_format=CL))
    return errs, mode.seen


def split(x: torch.Tensor, grid: ProcessGrid, halo: tuple[int, ...]) -> torch.Tensor:
    padded, started = start_halo_exchange(x, grid, halo)
    return finish_halo_exchange(padded, started)


def conv_pair(pg: ProcessGrid, dtype: torch.dtype, stride: int, overlap: bool):
    """Two equal ``DistConv3d``; the second's weight in ``channels_last_3d``."""
    pair = [
        DistConv3d(C_IN, C_OUT, 3, pg, stride=stride, overlap=overlap, broadcast=False,
                   device=DEVICE, dtype=dtype)
        for _ in range(2)
    ]  # fmt: skip
    with torch.no_grad():
        for p, q in zip(pair[0].parameters(), pair[1].parameters(), strict=True):
            q.copy_(p)
    return pair[0], pair[1].to(memory_format=CL)


def main() -> None:
    global DEVICE
    torch.set_num_threads(1)
    dtypes = (torch.float32, torch.float64)
    DEVICE = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    if DEVICE.type == "cuda":  # every rank on this GPU, over gloo
        torch.cuda.set_device(DEVICE)
        torch.backends.cudnn.allow_tf32 = False  # float32 really: both layouts round alike
        torch.backends.cuda.matmul.allow_tf32 = False
        dtypes = (torch.float32,)
    rank, world = init_distributed()
    results = {}
    for parts in PARTS[world]:
        pg = ProcessGrid.create(parts)
        for dtype in dtypes:
            x = block(pg, 1, C_IN, dtype)
            name = f"parts={parts} {str(dtype)[6:]}"
            for halo in ((1, 1, 1), (2, 1, 0)):
                for how, fn in (("whole", halo_exchange), ("split", split)):
                    f = functools.partial(fn, grid=pg, halo=halo)
                    errs, seen = compare(f, [], f, [], x, 2)
                    results[f"halo {halo} {how}, {name}"] = gathered(errs, seen)
            for overlap, stride in ((True, 1), (False, 1), (False, 2)):
                conv, cl_conv = conv_pair(pg, dtype, stride, overlap)
                params, cl_params = list(conv.parameters()), list(cl_conv.parameters())
                errs, seen = compare(conv, params, cl_conv, cl_params, x, 3)
                errs["overlapped"] = float(conv.overlapped())
                results[f"conv overlap={overlap} stride={stride}, {name}"] = gathered(errs, seen)
    write_results(results, rank)


if __name__ == "__main__":
    main()

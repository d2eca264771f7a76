"""Under ``mpiexec -n N python -m mpi4py``: halo exchange and DistConv3d against single-process
references, for every spatial split in CASES that fits N ranks; rank 0 writes the worst errors
over all ranks as JSON ``{case: {check: error}}``. The halo is checked whole and split into
start and finish (the overlapped path); DistConv3d with ``overlap`` on and off.

Also runs under torchrun, or as one plain process (``CASES[1]``).

With DEVICE ``cuda`` the split tensors and layers live on the GPU (every rank on it, over gloo:
messages staged through pinned host memory); the references stay on the CPU.

Usage: spatial_job.py OUT_JSON [DEVICE]
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist
from job_results import write_results
from torch import nn

from datastore.maths.partition import Grid, block_bounds, extract_block
from trainer.grid import ProcessGrid, init_distributed
from trainer.halo import (
    exchange_axes,
    finish_halo_exchange,
    halo_exchange,
    start_halo_exchange,
    wait_clock,
)
from trainer.layers import DistConv3d, sum_spatial_grads

DEVICE = torch.device("cpu")  # where the split tensors live (argv[2])
SHAPE = (9, 8, 7)  # uneven on purpose: 9 into 4 gives (3, 2, 2, 2)
N, C_IN, C_OUT = 2, 3, 4
OVERLAPS = (False, True)  # DistConv3d(overlap=...) per conv case
# (parts, halos, kernel sizes); the data-parallel size is world // prod(parts).
CASES = {
    1: [((1, 1, 1), [(1, 1, 1), (2, 1, 0)], [3, 5])],  # one process, no launcher
    2: [
        ((2, 1, 1), [(1, 1, 1), (2, 2, 2)], [3, 5]),
        ((1, 2, 1), [(1, 1, 1), (2, 2, 2)], [3]),
        ((1, 1, 2), [(1, 1, 1), (2, 1, 0)], [3]),
        ((1, 1, 1), [(1, 1, 1)], [3]),  # data-parallel only: the halo is pure zero padding
    ],
    4: [
        ((4, 1, 1), [(1, 1, 1), (2, 2, 2)], [3, 5]),
        ((2, 2, 1), [(1, 1, 1), (2, 2, 2)], [3]),
        ((1, 2, 2), [(1, 1, 1), (2, 2, 2)], [3]),
        ((2, 1, 2), [(2, 1, 1)], [3]),
        ((1, 2, 1), [(1, 1, 1), (2, 2, 2)], [3]),  # data-parallel 2 x spatial 2
    ],
    8: [((2, 2, 2), [(1, 1, 1), (2, 2, 2)], [3])],  # 3-D corners arrive in three hops
}


def volume(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def owned(t: torch.Tensor, grid: Grid, index: int) -> torch.Tensor:
    return t[(slice(None), slice(None), *block_bounds(grid, index))]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def worst(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _split_halo(x: torch.Tensor, pg: ProcessGrid, halo: tuple[int, ...]) -> torch.Tensor:
    padded, started = start_halo_exchange(x, pg, halo)
    return finish_halo_exchange(padded, started)


def check_halo(pg: ProcessGrid, halo: tuple[int, ...]) -> dict[str, float]:
    grid = Grid(SHAPE, pg.parts, halo, "zero")
    s = pg.spatial_rank
    errs = {}
    for prefix, fn in (("", halo_exchange), ("split_", _split_halo)):
        # <H x, y> == <x, H^T y>, both sides summed over the spatial group; x, y differ per rank.
        x = volume(100 + pg.rank, (N, C_IN, *SHAPE), torch.float64)
        x = owned(x, grid, s).clone().to(DEVICE).requires_grad_()
        hx = fn(x, pg, halo)
        y = torch.randn(
            hx.shape, generator=torch.Generator().manual_seed(200 + pg.rank), dtype=torch.float64
        ).to(DEVICE)
        (hx * y).sum().backward()
        sides = torch.stack([(hx * y).sum(), (x * x.grad).sum()]).detach().cpu()
        dist.all_reduce(sides, group=pg.spatial_group)
        adjoint = float((sides[0] - sides[1]).abs() / sides.abs().max())
        # Forward values: the block with halo cut from the zero-padded whole volume.
        v = volume(300 + pg.data_rank, (N, C_IN, *SHAPE), torch.float32)
        got = fn(owned(v, grid, s).clone().to(DEVICE), pg, halo).cpu()
        want = torch.from_numpy(extract_block(v.numpy(), grid, s, spatial_axes=(2, 3, 4)))
        forward = float((got - want).abs().max()) if got.shape == want.shape else math.inf
        errs[f"{prefix}adjoint_rel"] = worst(adjoint)
        errs[f"{prefix}forward_abs"] = worst(forward)
    return errs


def check_conv(pg: ProcessGrid, k: int, overlap: bool) -> dict[str, float]:
    grid = Grid(SHAPE, pg.parts, (k // 2,) * 3, "zero")
    s = pg.spatial_rank
    torch.manual_seed(pg.rank)  # different init everywhere: the broadcast must make them equal
    layer = DistConv3d(C_IN, C_OUT, k, pg, overlap=overlap).to(DEVICE)
    axes = exchange_axes(pg, layer.halo)
    overlapped = float(layer.overlapped() != (overlap and bool(axes)))
    hi, lo = layer.weight.detach().cpu(), layer.weight.detach().cpu()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    same_weights = float((hi - lo).abs().max())
    ref = nn.Conv3d(C_IN, C_OUT, k, padding=k // 2)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    # The reference for every data rank's sample, to check the data group sum too.
    refs = []
    for d in range(pg.data_size):
        ref.zero_grad()
        v = volume(400 + d, (N, C_IN, *SHAPE), torch.float32).requires_grad_()
        g = volume(500 + d, (N, C_OUT, *SHAPE), torch.float32)
        out = ref(v)
        (out * g).sum().backward()
        refs.append((v, g, out.detach(), ref.weight.grad.clone(), ref.bias.grad.clone()))
    v, g, out_ref, wg_ref, bg_ref = refs[pg.data_rank]
    x = owned(v.detach(), grid, s).clone().to(DEVICE).requires_grad_()
    wait_clock.reset()
    out = layer(x)
    (out * owned(g, grid, s).to(DEVICE)).sum().backward()
    # One timed wait per exchanging axis, forward and backward, on either path.
    waits = abs(wait_clock.forward_waits - len(axes)) + abs(wait_clock.backward_waits - len(axes))
    sum_spatial_grads(layer.parameters(), pg)
    errs = {
        "same_weights": same_weights,
        "overlapped": overlapped,
        "wait_count": float(waits),
        "output_rel": rel(out.detach().cpu(), owned(out_ref, grid, s)),
        "input_grad_rel": rel(x.grad.cpu(), owned(v.grad, grid, s)),
        "weight_grad_rel": rel(layer.weight.grad.cpu(), wg_ref),
        "bias_grad_rel": rel(layer.bias.grad.cpu(), bg_ref),
    }
    weight_grad = layer.weight.grad.cpu()
    dist.all_reduce(weight_grad, group=pg.data_group)
    errs["data_sum_rel"] = rel(weight_grad, sum(r[3] for r in refs))
    return {key: worst(e) for key, e in errs.items()}


def main() -> None:
    global DEVICE
    torch.set_num_threads(1)
    if len(sys.argv) > 2:  # every rank on this GPU, over gloo: halos staged through host memory
        DEVICE = torch.device(sys.argv[2])
        torch.cuda.set_device(DEVICE)
        torch.backends.cudnn.allow_tf32 = False  # float32 really, for the 1e-5 tolerances
        torch.backends.cuda.matmul.allow_tf32 = False
    rank, world = init_distributed()
    results: dict[str, dict[str, float]] = {}
    for parts, halos, kernels in CASES[world]:
        pg = ProcessGrid.create(parts)
        name = f"parts={parts}, data={pg.data_size}"
        for halo in halos:
            results[f"halo {halo}, {name}"] = check_halo(pg, halo)
        for k in kernels:
            for overlap in OVERLAPS:
                results[f"conv k={k} overlap={overlap}, {name}"] = check_conv(pg, k, overlap)
    write_results(results, rank)


if __name__ == "__main__":
    main()

"""Under ``mpiexec -n N python -m mpi4py``: the spatial layers against single-process ``torch.nn``
(float64), for every split in ``CASES[N]``; rank 0 writes the worst errors over all ranks as JSON
``{case: {check: error}}`` (``case`` as :func:`case_keys` lists them).

Checked: strided ``DistConv3d`` (stride 1 with and without overlapping the halo exchange),
``DistMaxPool3d``/``DistAvgPool3d``, ``DistBatchNorm3d`` with statistics over the spatial group
and over the world (two steps: running statistics, then outputs and gradients; then evaluation
mode), ``global_avg_pool``, ``gather_flatten``, and a
small CosmoFlow-like chain of them ending in a dense layer. Output blocks are cut from the
reference by the ownership rule of ``trainer.geometry``; ``tiles`` checks that they cover the
reference output exactly once.

Usage: layers_job.py OUT_JSON
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from job_results import write_results
from torch import nn

from datastore.maths.partition import Grid, block_bounds
from trainer.grid import ProcessGrid, init_distributed
from trainer.layers import DistConv3d, broadcast_parameters, sum_spatial_grads
from trainer.norm import DistBatchNorm3d
from trainer.pool import DistAvgPool3d, DistMaxPool3d, gather_flatten, global_avg_pool

DT = torch.float64
N, C_IN, C_OUT = 2, 3, 4
# Spatial parts per case; the data-parallel size is world // prod(parts).
CASES = {
    2: [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
    4: [(4, 1, 1), (2, 2, 1), (1, 2, 2), (2, 1, 1)],  # the last: 2 data x 2 spatial
}
# Axis length by blocks along it: split axes end in a shorter (odd) block, 7 -> (4, 3),
# 15 -> (4, 4, 4, 3); axis 1 has even lengths, 8 -> (4, 4); unsplit axes are odd.
LENGTHS = ({1: 5, 2: 7, 4: 15}, {1: 6, 2: 8, 4: 16}, {1: 5, 2: 7, 4: 15})
CONVS = [(3, 1), (5, 1), (3, 2), (5, 2), (1, 2)]  # (kernel, stride)
# k5 s1 on the 4-voxel middle blocks of 15 -> (4, 4, 4, 3): an empty interior, all shell


def overlaps(stride: int) -> tuple[bool, ...]:
    """``DistConv3d(overlap=...)`` values checked: both for stride 1, the default otherwise."""
    return (False, True) if stride == 1 else (True,)


# (kind, kernel, stride); stride > kernel needs no halo either
POOLS = [("max", 2, 2), ("avg", 2, 2), ("max", (1, 2, 1), 2), ("avg", (2, 1, 1), (2, 2, 2))]
# stats group names; "world" spans the data groups too
BNS = ["spatial", "world"]


def case_name(parts: Sequence[int], world: int) -> str:
    return f"parts={tuple(parts)}, data={world // math.prod(parts)}"


def case_keys(world: int) -> list[str]:
    """Every result key the job writes for ``world`` ranks, in order."""
    out = []
    for parts in CASES[world]:
        name = case_name(parts, world)
        out += [f"conv k={k} s={s} overlap={o}, {name}" for k, s in CONVS for o in overlaps(s)]
        out += [f"{kind}pool k={k} s={s}, {name}" for kind, k, s in POOLS]
        out += [f"batchnorm stats={g}, {name}" for g in BNS]
        out += [f"batchnorm float32 mean=100, {name}"]
        out += [f"global_avg_pool, {name}", f"gather_flatten, {name}", f"chain, {name}"]
    return out


def volume(seed: int, shape: Sequence[int]) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=DT)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def worst(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def tiles(local: torch.Tensor, ref: torch.Tensor, pg: ProcessGrid) -> float:
    """``|sum over the spatial group of owned outputs - reference outputs|`` (0: a tiling)."""
    t = torch.tensor([float(local.numel())], dtype=torch.float64)
    dist.all_reduce(t, group=pg.spatial_group)
    return abs(float(t) - ref.numel())


def _triple(v: int | Sequence[int]) -> tuple[int, ...]:
    return (v,) * 3 if isinstance(v, int) else tuple(v)


def out_block(
    bounds: Sequence[slice], kernel: int | Sequence[int], stride: int | Sequence[int], pool: bool
) -> tuple[slice, ...]:
    """The outputs anchored in the input block ``bounds``: ``o * s`` in ``[a, a + n)``."""
    out = []
    for b, k, s in zip(bounds, _triple(kernel), _triple(stride), strict=True):
        a, n = b.start, b.stop - b.start
        count = (n - k) // s + 1 if pool else -(-n // s)
        out.append(slice(a // s, a // s + count))
    return tuple(out)


def spatial(t: torch.Tensor, where: Sequence[slice]) -> torch.Tensor:
    return t[(slice(None), slice(None), *where)]


class Case:
    """One split: this rank's grid, the volume shape and its owned input block."""

    def __init__(self, parts: tuple[int, ...]) -> None:
        self.pg = ProcessGrid.create(parts)
        self.shape = tuple(LENGTHS[a][p] for a, p in enumerate(parts))
        self.bounds = block_bounds(Grid(self.shape, parts), self.pg.spatial_rank)

    def inputs(self, seed: int, c: int = C_IN) -> list[torch.Tensor]:
        """The whole input of every data rank (to build references of the data-group sum)."""
        return [volume(seed + d, (N, c, *self.shape)) for d in range(self.pg.data_size)]

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        return spatial(whole, self.bounds).clone().requires_grad_()


def check_conv(case: Case, k: int, s: int, overlap: bool) -> dict[str, float]:
    pg = case.pg
    torch.manual_seed(pg.rank)  # differs per rank: the broadcast must make the weights equal
    layer = DistConv3d(C_IN, C_OUT, k, pg, stride=s, dtype=DT, overlap=overlap)
    # overlap=True overlaps exactly for stride 1 (every case here splits an axis, k // 2 > 0)
    overlapped = float(layer.overlapped() != (overlap and s == 1 and k > 1))
    ref = nn.Conv3d(C_IN, C_OUT, k, stride=s, padding=k // 2, dtype=DT)
    with torch.no_grad():
        ref.weight.copy_(layer.weight)
        ref.bias.copy_(layer.bias)
    wgrads, bgrads = [], []
    for d, v in enumerate(case.inputs(400)):
        v.requires_grad_()
        ref.zero_grad()
        out_ref = ref(v)
        g = volume(500 + d, out_ref.shape)
        (out_ref * g).sum().backward()
        wgrads.append(ref.weight.grad.clone())
        bgrads.append(ref.bias.grad.clone())
        if d == pg.data_rank:
            mine_v, mine_out, mine_g = v, out_ref.detach(), g
    x = case.mine(mine_v.detach())
    out = layer(x)
    where = out_block(case.bounds, k, s, pool=False)
    (out * spatial(mine_g, where)).sum().backward()
    sum_spatial_grads(layer.parameters(), pg)
    errs = {
        "overlapped": overlapped,
        "tiles": tiles(out, mine_out, pg),
        "output_rel": rel(out.detach(), spatial(mine_out, where)),
        "input_grad_rel": rel(x.grad, spatial(mine_v.grad, case.bounds)),
        "weight_grad_rel": rel(layer.weight.grad, wgrads[pg.data_rank]),
        "bias_grad_rel": rel(layer.bias.grad, bgrads[pg.data_rank]),
    }
    dist.all_reduce(layer.weight.grad, group=pg.data_group)
    errs["data_sum_rel"] = rel(layer.weight.grad, sum(wgrads))
    return errs


def check_pool(case: Case, kind: str, k, s) -> dict[str, float]:
    pg = case.pg
    pair = (DistMaxPool3d, nn.MaxPool3d) if kind == "max" else (DistAvgPool3d, nn.AvgPool3d)
    dist_cls, ref_cls = pair
    layer, ref = dist_cls(k, pg, stride=s), ref_cls(k, stride=s)
    v = case.inputs(600)[pg.data_rank].requires_grad_()
    out_ref = ref(v)
    g = volume(700 + pg.data_rank, out_ref.shape)
    (out_ref * g).sum().backward()
    x = case.mine(v.detach())
    out = layer(x)
    where = out_block(case.bounds, k, s, pool=True)
    (out * spatial(g, where)).sum().backward()
    return {
        "tiles": tiles(out, out_ref, pg),
        "output_rel": rel(out.detach(), spatial(out_ref.detach(), where)),
        "input_grad_rel": rel(x.grad, spatial(v.grad, case.bounds)),
    }


def check_batchnorm(case: Case, stats: str) -> dict[str, float]:
    """Two training steps and one evaluation step; the second training step is checked fully."""
    pg = case.pg
    group = pg.spatial_group if stats == "spatial" else dist.group.WORLD
    layer = DistBatchNorm3d(C_IN, pg, stats_group=group, dtype=DT)
    with torch.no_grad():  # non-trivial gamma and beta, equal on every rank
        layer.weight.copy_(volume(800, (C_IN,)))
        layer.bias.copy_(volume(801, (C_IN,)))
    # One reference per stats group: per data rank ("spatial") or all data ranks concatenated.
    every = list(range(pg.data_size))
    groups = [[d] for d in every] if stats == "spatial" else [every]
    mine = next(i for i, ds in enumerate(groups) if pg.data_rank in ds)
    refs = []
    for _ in groups:
        ref = nn.BatchNorm3d(C_IN, dtype=DT)
        with torch.no_grad():
            ref.weight.copy_(layer.weight)
            ref.bias.copy_(layer.bias)
        refs.append(ref)
    # Step 1: running statistics only; inputs with a large mean (cancellation test).
    steps = [[10 + 3 * v for v in case.inputs(900)], case.inputs(1000)]
    grads = [volume(1100 + d, (N, C_IN, *case.shape)) for d in range(pg.data_size)]
    for step, vs in enumerate(steps):
        x = case.mine(vs[pg.data_rank])
        out = layer(x)
        if step == 1:
            (out * spatial(grads[pg.data_rank], case.bounds)).sum().backward()
    for ref, ds in zip(refs, groups, strict=True):
        for step, vs in enumerate(steps):
            v = torch.cat([vs[d] for d in ds]).requires_grad_()
            out_ref = ref(v)
            if step == 1:
                (out_ref * torch.cat([grads[d] for d in ds])).sum().backward()
                if ref is refs[mine]:
                    row = ds.index(pg.data_rank)
                    out_mine = out_ref.detach()[row * N : (row + 1) * N]
                    vgrad_mine = v.grad[row * N : (row + 1) * N]
    ref = refs[mine]
    sum_spatial_grads(layer.parameters(), pg)
    errs = {
        "output_rel": rel(out.detach(), spatial(out_mine, case.bounds)),
        "input_grad_rel": rel(x.grad, spatial(vgrad_mine, case.bounds)),
        "running_mean_rel": rel(layer.running_mean, ref.running_mean),
        "running_var_rel": rel(layer.running_var, ref.running_var),
        "batches_tracked": float(abs(int(layer.num_batches_tracked - ref.num_batches_tracked))),
    }
    # gamma and beta: this rank's share, summed over the spatial group, then the data group,
    # equals the sum of the references' gradients
    for name in ("weight", "bias"):
        grad = getattr(layer, name).grad
        dist.all_reduce(grad, group=pg.data_group)
        errs[f"{name}_grad_rel"] = rel(grad, sum(getattr(r, name).grad for r in refs))
    layer.eval()
    ref.eval()
    v = case.inputs(1200)[pg.data_rank]
    errs["eval_output_rel"] = rel(layer(case.mine(v)).detach(), spatial(ref(v), case.bounds))
    return errs


def check_batchnorm_float32(case: Case) -> dict[str, float]:
    """float32 input of mean 100 and deviation 1 against a float64 reference: the statistics
    must not lose the variance to cancellation (``E[x^2] - E[x]^2`` in float32 would)."""
    pg = case.pg
    layer = DistBatchNorm3d(C_IN, pg, stats_group=pg.spatial_group, dtype=torch.float32)
    ref = nn.BatchNorm3d(C_IN, dtype=DT)
    v = (100 + case.inputs(1250)[pg.data_rank]).float().double().requires_grad_()
    out_ref = ref(v)
    g = volume(1260 + pg.data_rank, out_ref.shape)
    (out_ref * g).sum().backward()
    x = spatial(v.detach(), case.bounds).float().requires_grad_()
    out = layer(x)
    (out * spatial(g, case.bounds).float()).sum().backward()
    return {
        "output_rel": rel(out.double(), spatial(out_ref, case.bounds)),
        "input_grad_rel": rel(x.grad.double(), spatial(v.grad, case.bounds)),
        "running_var_rel": rel(layer.running_var.double(), ref.running_var),
    }


def check_global(case: Case, fn: Callable, ref_fn: Callable) -> dict[str, float]:
    pg = case.pg
    v = case.inputs(1300)[pg.data_rank].requires_grad_()
    out_ref = ref_fn(v)
    g = volume(1400 + pg.data_rank, out_ref.shape)  # the same on every rank of the sample
    (out_ref * g).sum().backward()
    x = case.mine(v.detach())
    out = fn(x, pg)
    (out * g).sum().backward()
    return {
        "output_rel": rel(out.detach(), out_ref.detach()),
        "input_grad_rel": rel(x.grad, spatial(v.grad, case.bounds)),
    }


class Chain(nn.Module):
    """conv k3 -> batchnorm -> relu -> maxpool 2 -> conv k3 stride 2 -> flatten -> dense."""

    def __init__(
        self, convs: Sequence[nn.Module], bn: nn.Module, pool: nn.Module, dense: nn.Module
    ) -> None:
        super().__init__()
        self.conv1, self.conv2 = convs
        self.bn, self.pool, self.dense = bn, pool, dense

    def forward(self, x: torch.Tensor, flatten: Callable) -> torch.Tensor:
        y = self.pool(torch.relu(self.bn(self.conv1(x))))
        return self.dense(flatten(self.conv2(y)))


def check_chain(case: Case) -> dict[str, float]:
    pg = case.pg
    convs = [
        DistConv3d(C_IN, C_OUT, 3, pg, dtype=DT),
        DistConv3d(C_OUT, 2, 3, pg, stride=2, dtype=DT),
    ]
    ref_convs = [
        nn.Conv3d(C_IN, C_OUT, 3, padding=1, dtype=DT),
        nn.Conv3d(C_OUT, 2, 3, stride=2, padding=1, dtype=DT),
    ]
    for a, b in zip(convs, ref_convs, strict=True):
        b.load_state_dict(a.conv.state_dict())
    features = 2 * math.prod((n // 2 - 1) // 2 + 1 for n in case.shape)
    dense = nn.Linear(features, 5, dtype=DT)
    broadcast_parameters(dense)
    ref_dense = nn.Linear(features, 5, dtype=DT)
    ref_dense.load_state_dict(dense.state_dict())
    bn = DistBatchNorm3d(C_OUT, pg, stats_group=pg.spatial_group, dtype=DT)
    model = Chain(convs, bn, DistMaxPool3d(2, pg), dense)
    ref = Chain(ref_convs, nn.BatchNorm3d(C_OUT, dtype=DT), nn.MaxPool3d(2), ref_dense)
    v = case.inputs(1500)[pg.data_rank].requires_grad_()
    out_ref = ref(v, lambda t: torch.flatten(t, 1))
    g = volume(1600 + pg.data_rank, out_ref.shape)
    (out_ref * g).sum().backward()
    x = case.mine(v.detach())
    out = model(x, lambda t: gather_flatten(t, pg))
    (out * g).sum().backward()
    # Spatially split layers hold block shares; the replicated dense layer holds the whole.
    split = [*model.conv1.parameters(), *model.conv2.parameters(), *model.bn.parameters()]
    sum_spatial_grads(split, pg)
    return {
        "output_rel": rel(out.detach(), out_ref.detach()),
        "input_grad_rel": rel(x.grad, spatial(v.grad, case.bounds)),
        "conv1_weight_grad_rel": rel(model.conv1.weight.grad, ref.conv1.weight.grad),
        "conv2_weight_grad_rel": rel(model.conv2.weight.grad, ref.conv2.weight.grad),
        "bn_weight_grad_rel": rel(model.bn.weight.grad, ref.bn.weight.grad),
        "dense_weight_grad_rel": rel(model.dense.weight.grad, ref.dense.weight.grad),
    }


def main() -> None:
    torch.set_num_threads(1)
    rank, world = init_distributed()
    results: dict[str, dict[str, float]] = {}

    def put(key: str, errs: dict[str, float]) -> None:
        results[key] = {check: worst(e) for check, e in errs.items()}

    for parts in CASES[world]:
        case = Case(parts)
        name = case_name(parts, world)
        for k, s in CONVS:
            for o in overlaps(s):
                put(f"conv k={k} s={s} overlap={o}, {name}", check_conv(case, k, s, o))
        for kind, k, s in POOLS:
            put(f"{kind}pool k={k} s={s}, {name}", check_pool(case, kind, k, s))
        for stats in BNS:
            put(f"batchnorm stats={stats}, {name}", check_batchnorm(case, stats))
        put(f"batchnorm float32 mean=100, {name}", check_batchnorm_float32(case))
        mean = check_global(case, global_avg_pool, lambda t: t.mean((2, 3, 4)))
        put(f"global_avg_pool, {name}", mean)
        flat = check_global(case, gather_flatten, lambda t: torch.flatten(t, 1))
        put(f"gather_flatten, {name}", flat)
        put(f"chain, {name}", check_chain(case))
    assert list(results) == case_keys(world), (list(results), case_keys(world))
    write_results(results, rank)


if __name__ == "__main__":
    main()

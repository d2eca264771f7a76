"""Under ``mpiexec -n N python -m mpi4py``: GradientReducer and LionCub against explicit
collectives and single-process references, for every grid in CASES that fits N ranks; rank 0
writes the worst values over all ranks as JSON ``{case: {check: value}}``.

Usage: optim_job.py OUT_JSON
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from job_results import write_results
from torch import nn

from datastore.maths.partition import Grid, block_bounds
from trainer.grid import ProcessGrid, init_distributed
from trainer.layers import DistConv3d
from trainer.lion_cub import LionCub
from trainer.optim import Lion
from trainer.reduce import GradientReducer

F64 = torch.float64
SHAPE = (6, 4, 4)
N, C = 2, 2
# (bucket_bytes, reduce_data): one parameter per bucket, a few per bucket, all in one bucket;
# and the spatial sum alone.
REDUCERS = ((1, True), (400, True), (10**9, True), (400, False))
# Lion Cub: parameter shapes (66 numbers), groups by parameter index, steps, momentum sync.
LION_SHAPES = ((7, 5), (13,), (3, 3, 2))
LION_GROUPS = ({"idx": (0, 2), "lr": 0.01, "wd": 0.1}, {"idx": (1,), "lr": 0.02, "wd": 0.0})
BETAS = (0.9, 0.99)
STEPS, SYNC_EVERY = 6, 3
# (parts for the reducer, parts for Lion Cub); the data-parallel size is world // prod(parts).
CASES = {
    2: ([(1, 1, 1), (2, 1, 1)], [(1, 1, 1), (2, 1, 1)]),
    4: ([(2, 1, 1), (1, 2, 1)], [(1, 1, 1), (2, 1, 1), (4, 1, 1)]),
}


def rand(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def worst(value: float, op: dist.ReduceOp = dist.ReduceOp.MAX) -> float:
    t = torch.tensor([float(value)], dtype=F64)
    dist.all_reduce(t, op=op)
    return float(t)


def spread(t: torch.Tensor) -> float:
    """Largest difference of ``t`` between any two ranks."""
    hi, lo = t.detach().clone(), t.detach().clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).abs().max())


class Net(nn.Module):
    """Two spatially split convolutions and a per-voxel channel mix (spatially partial), and a
    head on a per-sample vector that every block of a sample computes in full (replicated)."""

    def __init__(self, pg: ProcessGrid) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = DistConv3d(C, 3, 3, pg, dtype=F64)
        self.conv2 = DistConv3d(3, 2, 3, pg, dtype=F64)
        self.mix = nn.Linear(2, 2, dtype=F64)
        self.head = nn.Linear(4, 1, dtype=F64)

    def loss(
        self, x: torch.Tensor, target: torch.Tensor, z: torch.Tensor, head: bool = True
    ) -> torch.Tensor:
        y = self.mix(self.conv2(torch.relu(self.conv1(x))).movedim(1, -1))
        return ((y - target) ** 2).sum() + (self.head(z) ** 2).sum() * head


def sample(d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Data rank ``d``'s sample: volume, per-voxel target, head input."""
    return rand(10 + d, (N, C, *SHAPE)), rand(20 + d, (N, *SHAPE, 2)), rand(30 + d, (N, 4))


def reference_grads(net: Net, data_size: int) -> tuple[list[torch.Tensor], list[list]]:
    """Single-process gradients of ``sum_d loss(sample d) / D`` (whole volumes), and of each
    sample's loss alone."""
    conv1, conv2 = (nn.Conv3d(a, b, 3, padding=1, dtype=F64) for a, b in ((C, 3), (3, 2)))
    ref = nn.ModuleDict({"c1": conv1, "c2": conv2, "mix": nn.Linear(2, 2, dtype=F64)})
    head = nn.Linear(4, 1, dtype=F64)
    with torch.no_grad():
        for dst, src in ((conv1, net.conv1.conv), (conv2, net.conv2.conv), (ref["mix"], net.mix)):
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
        head.weight.copy_(net.head.weight)
        head.bias.copy_(net.head.bias)
    params = [*ref.parameters(), *head.parameters()]  # Net's registration order
    per_sample = []
    for d in range(data_size):
        x, target, z = sample(d)
        y = ref["mix"](conv2(torch.relu(conv1(x))).movedim(1, -1))
        loss = ((y - target) ** 2).sum() + (head(z) ** 2).sum()
        per_sample.append([g.detach() for g in torch.autograd.grad(loss, params)])
    mean = [sum(gs) / data_size for gs in zip(*per_sample, strict=True)]
    return mean, per_sample


def local_backward(net: Net, pg: ProcessGrid, head: bool = True) -> None:
    x, target, z = sample(pg.data_rank)
    own = block_bounds(Grid(SHAPE, pg.parts), pg.spatial_rank)
    net.loss(x[(..., *own)], target[(slice(None), *own)], z, head).backward()


def explicit(net: Net, pg: ProcessGrid, reduce_data: bool) -> list[torch.Tensor]:
    """Per parameter: all_reduce over the spatial group (not the head), then the data mean."""
    out = []
    for name, p in net.named_parameters():
        g = p.grad.clone()
        if not name.startswith("head"):
            dist.all_reduce(g, group=pg.spatial_group)
        if reduce_data:
            dist.all_reduce(g, group=pg.data_group)
            g /= pg.data_size
        out.append(g)
    return out


def check_reducer(pg: ProcessGrid) -> dict[str, dict[str, float]]:
    results = {}
    plain = Net(pg)
    local_backward(plain, pg)
    want_mean, want_each = reference_grads(plain, pg.data_size)
    explicits = {flag: explicit(plain, pg, flag) for flag in (True, False)}
    for bucket_bytes, reduce_data in REDUCERS:
        want_ref = want_mean if reduce_data else want_each[pg.data_rank]
        want_explicit = explicits[reduce_data]
        net = Net(pg)
        reducer = GradientReducer(
            net,
            pg,
            bucket_bytes=bucket_bytes,
            spatially_partial=[p for n, p in net.named_parameters() if not n.startswith("head")],
            reduce_data=reduce_data,
        )
        r: dict[str, float] = {"buckets": len(reducer.buckets)}
        for round_ in range(2):  # the hooks re-arm after finish()
            local_backward(net, pg)
            r[f"launched_in_backward_{round_}"] = worst(
                reducer.launched == len(reducer.buckets), dist.ReduceOp.MIN
            )
            reducer.finish()
            got = [p.grad for p in net.parameters()]
            r[f"explicit_abs_{round_}"] = worst(
                max(float((a - b).abs().max()) for a, b in zip(got, want_explicit, strict=True))
            )
            r[f"single_rel_{round_}"] = worst(
                max(
                    float((a - b).abs().max() / b.abs().max())
                    for a, b in zip(got, want_ref, strict=True)
                )
            )
            if reduce_data:
                r[f"spread_{round_}"] = worst(max(spread(g) for g in got))
            net.zero_grad()
        # The head unused: its buckets start in finish(), its gradients come back as zeros.
        net.zero_grad(set_to_none=True)
        local_backward(net, pg, head=False)
        reducer.finish()
        r["unused_head_grad_abs"] = worst(
            max(float(p.grad.abs().max()) for p in net.head.parameters())
        )
        r["unused_head_others_abs"] = worst(
            max(
                float((p.grad - b).abs().max())
                for (n, p), b in zip(net.named_parameters(), want_explicit, strict=True)
                if not n.startswith("head")
            )
        )
        key = f"parts={pg.parts}, data={pg.data_size}, bucket={bucket_bytes}"
        results[f"reducer {key}, reduce_data={reduce_data}"] = r
    return results


def lion_grads(step: int, d: int) -> list[torch.Tensor]:
    gs = [rand(1000 + 100 * step + 10 * d + i, s) for i, s in enumerate(LION_SHAPES)]
    if step == 0 and d == 0:
        gs[0][0] = 0  # with zero momentum: zero votes (the packed mode's second plane)
    return gs


def lion_params() -> list[nn.Parameter]:
    return [nn.Parameter(rand(7 + i, s)) for i, s in enumerate(LION_SHAPES)]


def lion_groups(params: list[nn.Parameter]) -> list[dict]:
    return [
        {"params": [params[i] for i in g["idx"]], "lr": g["lr"], "weight_decay": g["wd"]}
        for g in LION_GROUPS
    ]


def run_optimizer(make, data_rank: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    params = lion_params()
    opt = make(lion_groups(params))
    for step in range(STEPS):
        for p, g in zip(params, lion_grads(step, data_rank), strict=True):
            p.grad = g
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params])
    return flat, m, opt


def simulate(data_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The majority-vote algorithm in one process, from every data rank's gradients."""
    b1, b2 = BETAS
    hyper = {i: (g["lr"], g["wd"]) for g in LION_GROUPS for i in g["idx"]}
    ps = [p.detach().clone() for p in lion_params()]
    ms = [[torch.zeros_like(p) for p in ps] for _ in range(data_size)]
    for step in range(STEPS):
        gs = [lion_grads(step, d) for d in range(data_size)]
        for i in range(len(ps)):
            votes = sum(torch.sign(b1 * ms[d][i] + (1 - b1) * gs[d][i]) for d in range(data_size))
            lr, wd = hyper[i]
            ps[i] = ps[i] * (1 - lr * wd) - lr * torch.sign(votes)
            for d in range(data_size):
                ms[d][i] = b2 * ms[d][i] + (1 - b2) * gs[d][i]
            if data_size > 1 and (step + 1) % SYNC_EVERY == 0:
                mean = sum(ms[d][i] for d in range(data_size)) / data_size
                for d in range(data_size):
                    ms[d][i] = mean.clone()
    flat_ms = [torch.cat([m.reshape(-1) for m in ms[d]]) for d in range(data_size)]
    return torch.cat([p.reshape(-1) for p in ps]), flat_ms


def check_lion_cub(pg: ProcessGrid) -> dict[str, dict[str, float]]:
    want_p, want_m = simulate(pg.data_size)
    runs = {}
    for mode in ("int8", "packed"):
        runs[mode] = run_optimizer(
            lambda groups, mode=mode: LionCub(
                groups, pg, 0.01, betas=BETAS, mode=mode, momentum_sync_every=SYNC_EVERY
            ),
            pg.data_rank,
        )
    lion_p, _, _ = run_optimizer(lambda groups: Lion(groups, 0.01, betas=BETAS), pg.data_rank)
    p8, m8, opt8 = runs["int8"]
    pk, mk, optk = runs["packed"]
    r = {
        "spread_params": worst(spread(p8)),
        "sim_params_abs": worst(float((p8 - want_p).abs().max())),
        "sim_momentum_abs": worst(float((m8 - want_m[pg.data_rank]).abs().max())),
        "packed_vs_int8_params": worst(float((pk - p8).abs().max())),
        "packed_vs_int8_momentum": worst(float((mk - m8).abs().max())),
        "lion_params_abs": worst(float((p8 - lion_p).abs().max())),
    }
    for name, opt in (("int8", opt8), ("packed", optk)):
        c = opt.comm
        r[f"{name}_bytes_sent"] = worst(c.bytes_sent)
        r[f"{name}_bytes_fp32"] = worst(c.bytes_fp32)
        r[f"{name}_bytes_saved"] = worst(c.bytes_saved)
        r[f"{name}_ratio"] = worst(c.ratio)
        r[f"{name}_bytes_sent_min"] = worst(c.bytes_sent, dist.ReduceOp.MIN)
    return {f"lion_cub parts={pg.parts}, data={pg.data_size}": r}


def main() -> None:
    torch.set_num_threads(1)
    rank, world = init_distributed()
    results: dict[str, dict[str, float]] = {}
    reducer_parts, lion_parts = CASES[world]
    for parts in reducer_parts:
        results.update(check_reducer(ProcessGrid.create(parts)))
    for parts in lion_parts:
        results.update(check_lion_cub(ProcessGrid.create(parts)))
    write_results(results, rank)


if __name__ == "__main__":
    main()

"""Under ``mpiexec -n N python -m mpi4py``: models built with ``DistLayers`` against the same
models built with ``TorchLayers`` in one process on the whole batch (float64).

For every grid in CASES that fits N ranks: CosmoFlow's output and every parameter gradient
after ``GradientReducer`` (head not spatially partial; the first dense layer's weight split by
columns, compared with the reference's columns), its state gathered whole and loaded back, and
a small U-Net (BatchNorm over the
world, transposed convolution) output block and gradients, for two steps of SGD and a third of
the trainer's LARS (whose trust ratio takes the split weight's whole norms), and the parameters
after it. Rank 0 writes
the worst errors over all ranks as JSON ``{case: {check: value}}``.

With DEVICE ``cuda`` the split models run on the GPU (every rank on GPU 0 over gloo: messages
staged through pinned host memory), against the same CPU references; the 8-rank case splits
all three axes.

Usage: dist_model_job.py OUT_JSON [DEVICE]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from datastore.maths.partition import Grid, block_bounds
from trainer.config import TrainConfig
from trainer.dense import DistFlattenLinear, whole_model_state
from trainer.dist_models import DistLayers
from trainer.grid import ProcessGrid, init_distributed
from trainer.models import CosmoFlow, TorchLayers, UNet3D
from trainer.reduce import GradientReducer
from trainer.train import build_optimizer

F64 = torch.float64
SIDE, C_IN, N_LOCAL = 8, 2, 2
# parts per world size; the data-parallel size is world // prod(parts).
CASES = {2: [(2, 1, 1)], 4: [(2, 1, 1), (2, 2, 1)], 8: [(2, 2, 2)]}
CUDA_CASES = {2: [(2, 1, 1), (1, 1, 2)], 4: [(2, 1, 1), (2, 2, 1)], 8: [(2, 2, 2)]}


def cosmoflow(layers) -> nn.Module:
    torch.manual_seed(0)
    return CosmoFlow(C_IN, 3, input_size=SIDE, conv_size=2, n_conv=2, fc1=8, fc2=4, layers=layers)


def unet(layers) -> nn.Module:
    torch.manual_seed(1)
    return UNet3D(C_IN, 2, base=2, depth=1, layers=layers)


def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn((n, C_IN, SIDE, SIDE, SIDE), generator=g, dtype=F64)
    return x, torch.rand((n, 3), generator=g, dtype=F64) * 2 - 1


def worst(value: float) -> float:
    t = torch.tensor([float(value)], dtype=F64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def check_case(pg: ProcessGrid, device: torch.device) -> dict[str, float]:
    n_total = N_LOCAL * pg.data_size
    x, y = batch(n_total)
    mine = slice(pg.data_rank * N_LOCAL, (pg.data_rank + 1) * N_LOCAL)
    own = block_bounds(Grid((SIDE,) * 3, pg.parts), pg.spatial_rank)
    xb = x[mine][(..., *own)].to(device)
    out: dict[str, float] = {}
    for name, build, loss_of in (
        ("cosmoflow", cosmoflow, lambda o, sl: ((o - y[sl]) ** 2).mean()),
        ("unet", unet, lambda o, sl: (o**2).mean()),
    ):
        ref = build(TorchLayers())
        layers = DistLayers(pg, dist.group.WORLD)
        model = build(layers).to(device)
        # The first dense layer's weight is split by columns: each rank holds its block's.
        cols = {id(m.weight): m.columns(pg.spatial_rank) for m in model.modules()
                if isinstance(m, DistFlattenLinear)}  # fmt: skip
        assert len(cols) == (name == "cosmoflow")

        def mine_of(p: torch.Tensor, r: torch.Tensor, cols=cols) -> torch.Tensor:
            return r[:, cols[id(p)]] if id(p) in cols else r

        ref_params, params = list(ref.parameters()), list(model.parameters())
        pairs = list(zip(params, ref_params, strict=True))
        assert [p.shape for p, _ in pairs] == [mine_of(p, r).shape for p, r in pairs]
        out[f"{name} init"] = max(max_err(p.cpu(), mine_of(p, r)) for p, r in pairs)
        reducer = GradientReducer(model, pg, spatially_partial=layers.spatially_partial())
        sgd = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = TrainConfig(data="-", optimizer="lars", lr=100.0, weight_decay=0.01)
        lars = build_optimizer(cfg, ref), build_optimizer(cfg, model, pg)
        for step, (ref_opt, opt) in enumerate((sgd, sgd, lars)):
            ref_opt.zero_grad()
            opt.zero_grad()
            ref_out = ref(x)
            ref_loss = loss_of(ref_out, slice(None))
            ref_loss.backward()
            got = model(xb).cpu()
            want = ref_out[mine] if name == "cosmoflow" else ref_out[mine][(..., *own)]
            out[f"{name} output step {step}"] = max_err(got, want.detach())
            # Every local loss is a mean over the rank's samples (a block's share for the U-Net,
            # whose loss the reducer's spatial sum completes); the reducer averages over D.
            scale = 1.0 if name == "cosmoflow" else xb[0, 0].numel() / x[0, 0].numel()
            (loss_of(got, mine) * scale).backward()  # back through .cpu() to the device
            reducer.finish()
            out[f"{name} grads step {step}"] = max(
                max_err(p.grad.cpu(), mine_of(p, r.grad)) for p, r in pairs
            )
            ref_opt.step()
            opt.step()
        out[f"{name} params after lars"] = max(max_err(p.cpu(), mine_of(p, r)) for p, r in pairs)
        reducer.remove()
        # A checkpoint holds the whole model's parameters (the split weight gathered on the
        # spatial group's first rank, the writer), and loading it into a fresh split model
        # gives this rank's columns back.
        whole = whole_model_state(model)
        assert (whole is None) == (pg.spatial_rank != 0 and name == "cosmoflow")
        named = [k for k, _ in model.named_parameters()]
        out[f"{name} whole state"] = 0.0 if whole is None else max(
            max_err(whole[k].cpu(), r) for k, r in zip(named, ref_params, strict=True)
        )  # fmt: skip
        shared = [whole]
        dist.broadcast_object_list(shared, group=pg.spatial_group, group_src=0)
        whole = shared[0]
        fresh = build(DistLayers(pg, dist.group.WORLD)).to(device)
        fresh.load_state_dict(whole)
        out[f"{name} state loaded"] = max(
            max_err(p.cpu(), q.cpu()) for p, q in zip(fresh.parameters(), params, strict=True)
        )
    return out


def main() -> None:
    torch.set_default_dtype(F64)
    out_path = sys.argv[1]
    device = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _, world = init_distributed()  # gloo: CUDA tensors are staged through host memory
    results = {}
    for parts in (CUDA_CASES if device.type == "cuda" else CASES)[world]:
        pg = ProcessGrid.create(parts)
        checks = check_case(pg, device)
        key = f"parts={parts}, data={pg.data_size}"
        results[key] = {k: worst(v) for k, v in checks.items()}
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump(results, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

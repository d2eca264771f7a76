"""Training steps that never wait for the device: the trainer's ``train_step`` on a grid, after
two warm-up steps (cuDNN's benchmark, NCCL's communicator, the agreed shapes), under a watch.

On the CPU (``mpiexec -n 2 python -m mpi4py``, or one plain process): every read of a tensor
into Python (``item``, ``tolist``, ``float()``, ...) a step makes, from a
``TorchFunctionMode``; each would be a host sync on a GPU. On a GPU (one plain process, NCCL):
``torch.cuda.set_sync_debug_mode("error")``, which raises on a synchronizing CUDA call; the
traceback is kept.

Rank 0 writes JSON ``{model: {"reads": [...], "error": str | null, "losses": [...]}}``.

Usage: host_sync_job.py OUT_JSON DATA_DIR DEVICE OPTIMIZER PARTS
(DEVICE ``cpu`` or ``cuda:N``, PARTS e.g. ``2,1,1``)
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from trainer.config import TrainConfig
from trainer.grid import init_distributed
from trainer.start import start
from trainer.train import Trainer

READS = {"item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__"}


class ScalarReads(TorchFunctionMode):
    """The tensor methods called that bring values to the host (``READS``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.calls.append(f"{name} of {tuple(args[0].shape)}" if args else name)
        return func(*args, **(kwargs or {}))


class SyncErrors:
    """``torch.cuda.set_sync_debug_mode("error")`` while inside."""

    calls: tuple[str, ...] = ()  # it raises instead

    def __enter__(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")


def steps(data: str, device: str, optimizer: str, parts: tuple[int, ...], model: str) -> dict:
    fields = {"input_field": "noisy", "target_field": "x"} if model == "unet3d" else {}
    cfg = TrainConfig(
        data=data, model=model, width=4, conv_blocks=2, global_batch=4, steps=4, lr=1e-3,
        optimizer=optimizer, device=device, spatial_parts=parts, **fields,
    )  # fmt: skip
    t = Trainer(cfg, start(cfg))
    try:
        it = iter(t.loader)
        batches = [next(it) for _ in range(4)]
        it.close()  # no prefetch thread runs beside the watched steps
        losses = [t.train_step(b, 0)[0] for b in batches[:2]]  # warm-up
        watch = SyncErrors() if t.run.device.type == "cuda" else ScalarReads()
        error = None
        try:
            with watch:
                for b in batches[2:]:
                    losses.append(t.train_step(b, 0)[0])
        except RuntimeError:
            error = traceback.format_exc()
        return {"reads": watch.calls, "error": error, "losses": t.losses_of(losses)}
    finally:
        t.close()


def main() -> None:
    out, data, device, optimizer, parts = sys.argv[1:6]
    torch.set_num_threads(1)
    spatial = tuple(int(p) for p in parts.split(","))
    gpu = device.startswith("cuda")
    init_distributed("nccl" if gpu else "gloo", device=torch.device(device) if gpu else None)
    results = {m: steps(data, device, optimizer, spatial, m) for m in ("cosmoflow", "unet3d")}
    everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
    if gpu:
        everyone = [results]  # one rank (NCCL has one GPU per rank)
    else:
        dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        merged = {
            m: {
                "reads": [f"rank {r}: {c}" for r, e in enumerate(everyone) for c in e[m]["reads"]],
                "error": next((e[m]["error"] for e in everyone if e[m]["error"]), None),
                "losses": results[m]["losses"],
            }
            for m in results
        }
        with open(out, "w") as f:
            json.dump(merged, f, indent=1)
    if not gpu:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

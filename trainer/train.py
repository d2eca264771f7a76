"""The training loop, one process or a hybrid data x spatial grid: ``DataStoreLoader`` batches,
MSE, checkpoints.

Hybrid parallel: under an MPI launcher (``mpiexec -n W python -m mpi4py -m trainer train``),
torchrun, or with ``spatial_parts`` other than ``[1, 1, 1]``, the driver starts
``torch.distributed`` and a :class:`~trainer.grid.ProcessGrid` of ``W / prod(spatial_parts)``
data-parallel replicas x ``spatial_parts`` blocks. Each rank's loader delivers its block of
every sample of its share of the global batch (no halo: ``DistConv3d`` exchanges its own), the
model is built from :class:`~trainer.dist_models.DistLayers` (the dense head replicated), and a
:class:`~trainer.reduce.GradientReducer` sums the split layers' gradients over the spatial
group and averages every gradient over the data group (``lion_cub`` votes over the data group
instead). Weights are equal on every rank (seeded alike); rank 0 logs (the loss averaged over
the data ranks, its own data wait) and writes checkpoints, every rank resumes from them.

``train(cfg)`` reads ``cfg.data/train.h5`` through the embedded ``DataStoreLoader`` (fields
``x`` and ``y``), trains the model on the mean squared error with SGD (momentum) or Adam, and
after every epoch and at the end (once when they coincide) compares the validation MSE on
``cfg.data/validation.h5`` with the baseline that predicts the mean training target.

Resume: with ``checkpoint_dir`` set, training starts from ``checkpoint.pt`` when there is one
(model, optimizer, loader position, step, torch RNG) and writes it every
``checkpoint_interval`` steps and at the end. A resumed run continues exactly as an
uninterrupted one: the same batches, losses and parameters, bit for bit.

Log (``log_file``, JSON lines, appended):

- per step: ``{"step", "epoch", "loss", "lr", "samples_per_s", "data_wait"}``, where
  ``data_wait`` is the share of the step spent blocked in ``next(loader)``;
- per validation: ``{"event": "validation", "step", "val_mse", "baseline_mse", "ratio",
  "val_mse_per_target", "baseline_per_target"}`` (also printed);
- per checkpoint: ``{"event": "checkpoint", "step", "path"}``.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Iterator
from typing import Any, TextIO

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from datastore import DataStoreLoader
from datastore.partition import Grid, block_bounds
from datastore.readers import open_dataset
from staging.cluster import launched_by_mpi, torchrun_world
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.comm import all_reduce_sum
from trainer.config import TrainConfig
from trainer.dist_models import DistLayers
from trainer.grid import ProcessGrid, init_distributed
from trainer.lion_cub import LionCub
from trainer.models import CosmoFlow, LayerFactory
from trainer.optim import LARS, Lion, split_decay_groups
from trainer.reduce import GradientReducer

__all__ = [
    "build_model",
    "build_optimizer",
    "data_paths",
    "lr_at",
    "read_field",
    "start_grid",
    "train",
]

FIELDS = ["x", "y"]


def data_paths(data: str) -> tuple[str, str]:
    """``(train.h5, validation.h5)`` in directory ``data``."""
    return os.path.join(data, "train.h5"), os.path.join(data, "validation.h5")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of step ``step`` (0-based): linear warm-up over ``cfg.warmup``, then flat."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr


def read_field(path: str, name: str) -> np.ndarray:
    """Every sample of field ``name`` in the dataset at ``path``, stacked."""
    with open_dataset(path) as ds:
        return np.stack([ds.read(i, name) for i in range(len(ds))])


def start_grid(cfg: TrainConfig) -> ProcessGrid | None:
    """The process grid when the run is distributed (a launcher's variables, or a spatial
    split), else ``None`` (one plain process)."""
    env = os.environ
    launched = launched_by_mpi(env) or torchrun_world(env) is not None
    if not (launched or dist.is_initialized() or cfg.spatial_parts != (1, 1, 1)):
        return None
    timeout = datetime.timedelta(seconds=cfg.comm_timeout)
    init_distributed(timeout=timeout)
    return ProcessGrid.create(cfg.spatial_parts, timeout=timeout)


def build_model(
    cfg: TrainConfig, in_channels: int, size: int, n_out: int, layers: LayerFactory | None = None
) -> nn.Module:
    """The model ``cfg.model`` for ``(in_channels, size, size, size)`` inputs."""
    n_conv = cfg.conv_blocks or min(5, int(np.log2(size)))
    return CosmoFlow(
        in_channels, n_out, input_size=size, conv_size=cfg.width, n_conv=n_conv,
        dropout=cfg.dropout, layers=layers,
    )  # fmt: skip


def build_optimizer(
    cfg: TrainConfig, model: nn.Module, grid: ProcessGrid | None = None
) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``model``'s parameters: ``sgd`` (with ``cfg.momentum``), ``adam``,
    ``lars`` (biases and norms excluded), ``lion``, or ``lion_cub`` (plain Lion without a grid)."""
    params, lr, wd = model.parameters(), cfg.lr, cfg.weight_decay
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=wd)
    if cfg.optimizer == "lars":
        return LARS(split_decay_groups(model, wd), lr=lr, momentum=cfg.momentum)
    if cfg.optimizer == "lion" or (cfg.optimizer == "lion_cub" and grid is None):
        return Lion(params, lr=lr, weight_decay=wd)
    if cfg.optimizer == "lion_cub":
        return LionCub(params, grid, lr=lr, weight_decay=wd)
    return torch.optim.Adam(params, lr=lr, weight_decay=wd)


def _evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, batch: int, grid: ProcessGrid | None
) -> np.ndarray:
    """The mean squared error of each target over the samples ``(x, y)``.

    On a grid, data rank ``d`` predicts samples ``d::D`` from its block of them; the squared
    errors are summed over the data group, so every rank returns the same numbers.
    """
    n = len(y)
    if grid is not None:
        own = block_bounds(Grid(x.shape[2:], grid.parts), grid.spatial_rank)
        x, y = x[grid.data_rank :: grid.data_size][(..., *own)], y[grid.data_rank :: grid.data_size]
    model.eval()
    total = torch.zeros(y.shape[1], dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(x), batch):
            pred = model(torch.from_numpy(np.ascontiguousarray(x[i : i + batch])))
            total += ((pred.double() - torch.from_numpy(y[i : i + batch])) ** 2).sum(0)
    model.train()
    if grid is not None:
        all_reduce_sum(total, grid.data_group, grid.timeout)
    return total.numpy() / n


def _batches(loader: DataStoreLoader) -> Iterator[tuple[dict[str, torch.Tensor] | None, float]]:
    """``(batch, seconds blocked in next(loader))``; ``(None, s)`` at the end of each epoch."""
    while True:
        it = iter(loader)
        try:
            while True:
                t0 = time.perf_counter()
                batch = next(it, None)
                yield batch, time.perf_counter() - t0
                if batch is None:
                    break
        finally:
            it.close()  # stops the prefetch thread now, not at garbage collection


class _Log:
    def __init__(self, path: str) -> None:
        self.fh: TextIO | None = open(path, "a") if path else None  # noqa: SIM115

    def write(self, record: dict[str, Any], echo: bool = False) -> None:
        line = json.dumps(record)
        if self.fh is not None:
            self.fh.write(line + "\n")
            self.fh.flush()
        if echo:
            print(line, flush=True)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


def _loader(cfg: TrainConfig, path: str, grid: ProcessGrid | None) -> Any:
    """This rank's ``DataStoreLoader`` (embedded, or the service at ``cfg.data_address``)."""
    kw: dict[str, Any] = dict(global_batch_size=cfg.global_batch, fields=FIELDS, seed=cfg.seed)
    if grid is not None:
        kw.update(rank=grid.rank, world=grid.world)
        if grid.spatial_size > 1:
            kw["spatial"] = {"parts": grid.parts, "halo": (0, 0, 0)}
    return DataStoreLoader(path, address=cfg.data_address or None, **kw)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; return ``{"steps", "losses" (this run's, averaged over the data
    ranks), "val_mse", "baseline_mse", "resumed_from", "rank"}``."""
    train_path, val_path = data_paths(cfg.data)
    grid = start_grid(cfg)
    lead = grid is None or grid.rank == 0
    torch.manual_seed(cfg.seed)  # the same weights on every rank
    loader = _loader(cfg, train_path, grid)
    with open_dataset(train_path) as ds:
        xinfo, yinfo = ds.fields["x"], ds.fields["y"]
    layers = None if grid is None else DistLayers(grid, grid.spatial_group)
    model = build_model(cfg, xinfo.shape[0], xinfo.shape[1], yinfo.shape[0], layers)
    opt = build_optimizer(cfg, model, grid)
    reducer = None
    if grid is not None:
        reducer = GradientReducer(
            model, grid, spatially_partial=layers.spatially_partial(),  # type: ignore[union-attr]
            reduce_data=cfg.optimizer != "lion_cub",
        )  # fmt: skip
    val_x, val_y = read_field(val_path, "x"), read_field(val_path, "y")
    y_mean = read_field(train_path, "y").mean(axis=0)
    baseline_per_target = ((val_y - y_mean) ** 2).mean(axis=0)
    baseline = float(baseline_per_target.mean())
    total = cfg.steps or cfg.epochs * len(loader)
    step, resumed_from = 0, None
    saved = load_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])
        torch.set_rng_state(saved["rng"])
        step = resumed_from = saved["step"]
    log = _Log(cfg.log_file if lead else "")
    losses: list[float] = []
    val_mse, validated_at, checkpointed_at = float("nan"), None, None

    def validate() -> None:
        nonlocal val_mse, validated_at
        per_target = _evaluate(model, val_x, val_y, cfg.global_batch, grid)
        val_mse, validated_at = float(per_target.mean()), step
        log.write(
            {"event": "validation", "step": step, "val_mse": val_mse,
             "baseline_mse": baseline, "ratio": val_mse / baseline,
             "val_mse_per_target": per_target.tolist(),
             "baseline_per_target": baseline_per_target.tolist()},
            echo=lead,
        )  # fmt: skip

    def checkpoint() -> None:
        nonlocal checkpointed_at
        checkpointed_at = step
        if not lead:  # the model is replicated: rank 0 writes for all
            return
        state = {
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "loader": loader.state_dict(), "rng": torch.get_rng_state(), "step": step,
            "config": cfg.to_dict(),
        }  # fmt: skip
        path = save_checkpoint(cfg.checkpoint_dir, state)
        log.write({"event": "checkpoint", "step": step, "path": path})

    def mean_loss(loss: torch.Tensor) -> float:
        if grid is None:
            return loss.item()
        t = loss.detach().double().reshape(1)
        return float(all_reduce_sum(t, grid.data_group, grid.timeout)) / grid.data_size

    loss_fn = nn.MSELoss()
    model.train()
    batches = _batches(loader)
    try:
        while step < total:
            t0 = time.perf_counter()
            epoch = loader.epoch  # the batch's: handing out an epoch's last batch moves it on
            batch, wait = next(batches)
            if batch is None:  # an epoch ended
                validate()
                continue
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch["x"]), batch["y"])
            loss.backward()
            if reducer is not None:
                reducer.finish()
            opt.step()
            step += 1
            losses.append(mean_loss(loss))
            seconds = time.perf_counter() - t0
            log.write(
                {"step": step, "epoch": epoch, "loss": losses[-1], "lr": lr,
                 "samples_per_s": cfg.global_batch / seconds, "data_wait": wait / seconds},
                echo=lead and cfg.print_every > 0 and step % cfg.print_every == 0,
            )  # fmt: skip
            if (
                cfg.checkpoint_dir
                and cfg.checkpoint_interval
                and step % cfg.checkpoint_interval == 0
            ):
                checkpoint()
        batches.close()
        if validated_at != step:
            validate()
        if cfg.checkpoint_dir and checkpointed_at != step:
            checkpoint()
    finally:
        batches.close()
        log.close()
        loader.close()
        if reducer is not None:
            reducer.remove()
    return {
        "steps": step, "losses": losses, "val_mse": val_mse, "baseline_mse": baseline,
        "resumed_from": resumed_from, "rank": 0 if grid is None else grid.rank,
    }  # fmt: skip

"""The training loop (single process for now): ``DataStoreLoader`` batches, MSE, checkpoints.

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

import json
import os
import time
from collections.abc import Iterator
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from datastore import DataStoreLoader
from datastore.readers import open_dataset
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import TrainConfig
from trainer.models import CosmoFlow

__all__ = ["build_model", "build_optimizer", "data_paths", "lr_at", "read_field", "train"]

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


def build_model(cfg: TrainConfig, in_channels: int, size: int, n_out: int) -> nn.Module:
    """The model ``cfg.model`` for ``(in_channels, size, size, size)`` inputs."""
    n_conv = min(5, int(np.log2(size)))
    return CosmoFlow(
        in_channels, n_out, input_size=size, conv_size=cfg.width, n_conv=n_conv,
        dropout=cfg.dropout,
    )  # fmt: skip


def build_optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` (with ``cfg.momentum``) or ``torch.optim.Adam``."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch: int) -> np.ndarray:
    """The mean squared error of each target over the samples ``(x, y)``."""
    model.eval()
    total = np.zeros(y.shape[1])
    with torch.no_grad():
        for i in range(0, len(x), batch):
            pred = model(torch.from_numpy(x[i : i + batch])).numpy().astype(np.float64)
            total += ((pred - y[i : i + batch]) ** 2).sum(axis=0)
    model.train()
    return total / len(y)


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


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; return ``{"steps", "losses" (this run's), "val_mse",
    "baseline_mse", "resumed_from"}``."""
    train_path, val_path = data_paths(cfg.data)
    torch.manual_seed(cfg.seed)
    loader = DataStoreLoader(
        train_path, global_batch_size=cfg.global_batch, fields=FIELDS, seed=cfg.seed
    )
    xinfo, yinfo = loader.reader.fields["x"], loader.reader.fields["y"]
    model = build_model(cfg, xinfo.shape[0], xinfo.shape[1], yinfo.shape[0])
    opt = build_optimizer(cfg, model.parameters())
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
    log = _Log(cfg.log_file)
    losses: list[float] = []
    val_mse, validated_at, checkpointed_at = float("nan"), None, None

    def validate() -> None:
        nonlocal val_mse, validated_at
        per_target = _evaluate(model, val_x, val_y, cfg.global_batch)
        val_mse, validated_at = float(per_target.mean()), step
        log.write(
            {"event": "validation", "step": step, "val_mse": val_mse,
             "baseline_mse": baseline, "ratio": val_mse / baseline,
             "val_mse_per_target": per_target.tolist(),
             "baseline_per_target": baseline_per_target.tolist()},
            echo=True,
        )  # fmt: skip

    def checkpoint() -> None:
        nonlocal checkpointed_at
        state = {
            "model": model.state_dict(), "optimizer": opt.state_dict(),
            "loader": loader.state_dict(), "rng": torch.get_rng_state(), "step": step,
            "config": cfg.to_dict(),
        }  # fmt: skip
        path, checkpointed_at = save_checkpoint(cfg.checkpoint_dir, state), step
        log.write({"event": "checkpoint", "step": step, "path": path})

    loss_fn = nn.MSELoss()
    model.train()
    batches = _batches(loader)
    try:
        while step < total:
            t0 = time.perf_counter()
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
            opt.step()
            step += 1
            seconds = time.perf_counter() - t0
            losses.append(loss.item())
            log.write(
                {"step": step, "epoch": loader.epoch, "loss": losses[-1], "lr": lr,
                 "samples_per_s": len(batch["x"]) / seconds, "data_wait": wait / seconds},
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
    return {
        "steps": step, "losses": losses, "val_mse": val_mse, "baseline_mse": baseline,
        "resumed_from": resumed_from,
    }  # fmt: skip

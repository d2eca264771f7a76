"""The training loop, one process or a hybrid data x spatial grid, on a GPU or the CPU:
``DataStoreLoader`` batches, MSE, validation against baselines, checkpoints.

Start (``trainer.start``): the rank's device and backend, the process group and every check,
agreed on by all ranks, then the :class:`~trainer.grid.ProcessGrid` of ``W / prod(spatial_parts)``
data-parallel replicas x ``spatial_parts`` blocks.

Data: the training and the validation loaders are ``DataStoreLoader``s over
``data/train_file`` and ``data/validation_file`` (fields ``input_field`` and
``target_field``), embedded or streamed from ``datastore serve`` at ``data_address``. With a
grid every rank gets its block of every sample of its share of the global batch (no halo:
``DistConv3d`` exchanges its own), and the data ranks hold the dataset once between them
through the loader's exchange (MPI, or ``torch.distributed``). On a GPU the loader delivers
batches on the device (``device=``, from pinned buffers on a side stream).

Model: ``cosmoflow`` (regression of the target vector) or ``unet3d`` (voxel-wise target), from
:class:`~trainer.dist_models.DistLayers` on a grid; on a GPU in ``channels_last_3d`` with bf16
autocast (``amp``) and ``cudnn.benchmark``. A :class:`~trainer.reduce.GradientReducer` sums the
split layers' gradients over the spatial group and averages every gradient over the data
group, bucket by bucket as backward produces them (``lion_cub`` votes over the data group
instead). Loss and metrics: ``trainer.metrics``. Learning rate: ``trainer.optim.lr_at`` of
``trainer.start.schedule_of``.

Validation, after every epoch and at the end (once when they coincide; before a checkpoint of
the same step), through the validation loader's blocks (every sample once:
``drop_last=False``, the padding masked): the MSE per target channel, next to predicting the
mean training target (accumulated over the first epoch's batches) and, for the U-Net when
input and target have the same channels, predicting the input.

Resume: with ``checkpoint_dir`` set, training starts from ``checkpoint.pt`` when there is one
(model, optimizer, loader position, step, each data rank's torch RNG: its dropout stream,
the target sums) and writes it every ``checkpoint_interval`` steps and at the end; rank 0
prints ``resumed from step N``. A resumed run continues exactly as an uninterrupted one.
``lion_cub``'s momenta differ between data ranks: each data rank's first rank writes
``optimizer.dR.stepN.pt`` beside it (``trainer.checkpoint.own_optimizer_name``; the last two
saves' are kept), and every rank resumes its own.

Log (``log_file``, JSON lines, appended; rank 0):

- per step: ``{"step", "epoch", "loss", "lr", "samples_per_s", "data_wait"}``, where
  ``data_wait`` is the share of the step spent blocked in ``next(loader)``. A step's loss stays
  on the device; the records are written every ``log_every`` steps (at a printed step, and
  before any other record), their losses read in one host sync, which that step's time
  includes: on a GPU a step's time is the host's, and their sum over the interval the
  device's;
- per validation: ``{"event": "validation", "step", "val_mse", "baseline_mse", "ratio",
  "val_mse_per_target", "baseline_per_target"}`` (plus ``"identity_mse"`` where it applies;
  also printed);
- ``{"event": "start", "device", "backend", "world", "spatial_parts", "data_source" (the
  loader's source: ``local``, ``mpi``, ``torch.distributed`` or ``service``), "total_steps"}``,
  ``{"event": "resumed", "step"}`` and per checkpoint ``{"event": "checkpoint", "step",
  "path"}``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import numpy as np
import torch
from torch import nn

from datastore import DataStoreLoader
from datastore.sources.options import ServiceOptions
from trainer.checkpoint import (
    load_checkpoint,
    load_own_optimizer,
    own_optimizer_missing,
    own_optimizer_name,
    prune_own_optimizer,
    save_checkpoint,
)
from trainer.comm import all_gather, all_reduce_sum
from trainer.config import ConfigError, TrainConfig
from trainer.dense import (
    own_optimizer_state,
    whole_model_state,
    whole_norms,
    whole_optimizer_state,
)
from trainer.dist_models import DistLayers
from trainer.grid import ProcessGrid
from trainer.lion_cub import LionCub
from trainer.metrics import Sums, local_loss
from trainer.model_table import model_named
from trainer.models import LayerFactory
from trainer.optim import LARS, Lion, lr_at, set_lr, split_decay_groups
from trainer.reduce import GradientReducer
from trainer.start import Run, data_address, data_paths, data_token, schedule_of, start

__all__ = [
    "Log",
    "StepRecords",
    "Trainer",
    "build_model",
    "build_optimizer",
    "fit",
    "loader_of",
    "timed_batches",
    "train",
]


def build_model(cfg: TrainConfig, run: Run, layers: LayerFactory | None = None) -> nn.Module:
    """The model ``cfg.model`` (``trainer.model_table``) for ``run``'s fields and depth (on the
    CPU); a name not in the table is refused, naming the ones that are."""
    return model_named(cfg.model).build(
        run.inputs[1][0], run.targets[1][0], tuple(run.inputs[1][1:]), width=cfg.width,
        depth=run.depth, dropout=cfg.dropout, layers=layers,
    )  # fmt: skip


def build_optimizer(
    cfg: TrainConfig, model: nn.Module, grid: ProcessGrid | None = None
) -> torch.optim.Optimizer:
    """``cfg.optimizer`` over ``model``'s parameters: ``sgd`` (with ``cfg.momentum``), ``adam``,
    ``lars`` (biases and norms excluded; a split weight's trust ratio from its whole norms),
    ``lion``, or ``lion_cub`` (plain Lion without a grid)."""
    params, lr, wd = model.parameters(), cfg.lr, cfg.weight_decay
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=wd)
    if cfg.optimizer == "lars":
        groups = split_decay_groups(model, wd)
        return LARS(groups, lr=lr, momentum=cfg.momentum, norms=whole_norms(model))
    if cfg.optimizer == "lion" or (cfg.optimizer == "lion_cub" and grid is None):
        return Lion(params, lr=lr, weight_decay=wd)
    if cfg.optimizer == "lion_cub":
        return LionCub(params, grid, lr=lr, weight_decay=wd)
    return torch.optim.Adam(params, lr=lr, weight_decay=wd)


def loader_of(cfg: TrainConfig, path: str, run: Run, validation: bool) -> DataStoreLoader:
    """This rank's loader of the dataset at ``path``: shuffled whole batches for training, or
    every sample once in order for validation."""
    kw: dict[str, Any] = dict(
        global_batch_size=cfg.global_batch, fields=[cfg.input_field, cfg.target_field],
        seed=cfg.seed, timeout=cfg.comm_timeout,
    )  # fmt: skip
    if validation:
        kw.update(shuffle=False, drop_last=False)
    if run.grid is None:  # one process (also one trainer of a tournament): the whole batch
        kw.update(rank=0, world=1)
    if run.grid is not None and run.grid.spatial_size > 1:
        kw["spatial"] = {"parts": run.grid.parts, "halo": (0, 0, 0)}
    if run.device.type == "cuda":
        kw.update(device=run.device, pin_memory=True)
    address = data_address(cfg)
    service = ServiceOptions(address, token=data_token(cfg)) if address else None
    return DataStoreLoader(path, service=service, **kw)


def timed_batches(
    loader: DataStoreLoader,
) -> Iterator[tuple[dict[str, torch.Tensor] | None, float]]:
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


class Log:
    """JSON lines appended to ``path`` (``""``: none), each record with ``label``'s keys."""

    def __init__(self, path: str, label: dict[str, Any] | None = None) -> None:
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.fh: TextIO | None = open(path, "a") if path else None  # noqa: SIM115
        self.label = label or {}

    def write(self, record: dict[str, Any], echo: bool = False) -> None:
        """Append ``record``; ``echo`` also prints it."""
        line = json.dumps({**self.label, **record})
        if self.fh is not None:
            self.fh.write(line + "\n")
            self.fh.flush()
        if echo:
            print(line, flush=True)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()


class Trainer:
    """One run's state and its steps (:func:`fit` drives it).

    ``label``: keys added to every log record (a tournament's ``{"trainer": k}``).
    """

    def __init__(self, cfg: TrainConfig, run: Run) -> None:
        self.cfg, self.run, grid = cfg, run, run.grid
        self.grid = grid
        self.lead = grid is None or grid.rank == 0
        self.task = model_named(cfg.model).task
        self.gpu = run.device.type == "cuda"
        if self.gpu:
            torch.cuda.set_device(run.device)
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        self.amp = self.gpu and cfg.amp
        self.memory_format = (
            torch.channels_last_3d if self.gpu and cfg.channels_last else torch.contiguous_format
        )
        torch.manual_seed(cfg.seed)  # the same weights on every rank
        train_path, val_path = data_paths(cfg)
        self.loader = loader_of(cfg, train_path, run, validation=False)
        self.val_loader = loader_of(cfg, val_path, run, validation=True)
        self.layers = None
        if grid is not None:
            self.layers = DistLayers(grid, grid.spatial_group, overlap=cfg.halo_overlap)
        model = build_model(cfg, run, self.layers)
        self.model = model.to(run.device, memory_format=self.memory_format)
        # dropout: a stream per data rank (the same on a replica's spatial ranks, whose dense
        # layers must agree), not every rank's samples masked alike
        torch.manual_seed(dropout_seed(cfg.seed, 0 if grid is None else grid.data_rank))
        self.opt = build_optimizer(cfg, self.model, grid)
        self.reducer = None
        if grid is not None:
            self.reducer = GradientReducer(
                self.model, grid, spatially_partial=self.layers.spatially_partial(),  # type: ignore[union-attr]
                reduce_data=cfg.optimizer != "lion_cub",
            )  # fmt: skip
        self.schedule = schedule_of(cfg, run.total_steps)
        self.whole_voxels = math.prod(run.targets[1][1:]) if self.task == "voxel" else 1
        self.target_sums = Sums(run.targets[1][0], run.device)
        self.step, self.resumed_from = 0, None
        self.saved_at: int | None = None  # the step of checkpoint.pt, once saved or resumed
        self.label: dict[str, Any] = {}

    # -- reductions over the world ----------------------------------------------------------------
    def _world_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.grid is not None:
            all_reduce_sum(t, None, self.grid.timeout)
        return t

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The step's loss for :meth:`losses_of`, on the device (no host sync): this process's,
        or its sum over the world."""
        if self.grid is None:
            return loss.detach()
        return self._world_sum(loss.detach().double().reshape(1))

    def losses_of(self, losses: list[torch.Tensor]) -> list[float]:
        """The replica MSEs, averaged over the data ranks, of steps' :meth:`mean_loss` values:
        one read from the device for all of them."""
        values = torch.cat([v.reshape(1) for v in losses]).tolist()
        if self.grid is None:
            return values
        # Voxel losses are per-block shares (sum over the sample's blocks); vector losses are
        # replicated on every block.
        per = self.grid.data_size if self.task == "voxel" else self.grid.world
        return [total / per for total in values]

    # -- steps ------------------------------------------------------------------------------------
    def _inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 whatever the dataset stores (float64, integers): the model's dtype
        x = batch[self.cfg.input_field].to(self.run.device, torch.float32, non_blocking=True)
        y = batch[self.cfg.target_field].to(self.run.device, torch.float32, non_blocking=True)
        if self.memory_format is not torch.contiguous_format:
            x = x.contiguous(memory_format=self.memory_format)
        return x, y

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.amp):
            return self.model(x)

    def train_step(self, batch: dict[str, torch.Tensor], epoch: int) -> tuple[torch.Tensor, float]:
        """One optimizer step; ``(loss, learning rate)``, the loss left on the device
        (:meth:`mean_loss`; read it with :meth:`losses_of`) so the host need not wait."""
        x, y = self._inputs(batch)
        if epoch == 0:
            self.target_sums.add(y)
        lr = lr_at(self.step, self.schedule)
        set_lr(self.opt, lr)
        self.opt.zero_grad(set_to_none=True)
        loss = local_loss(self._forward(x), y, self.task, self.whole_voxels)
        loss.backward()
        if self.reducer is not None:
            self.reducer.finish()
        self.opt.step()
        self.step += 1
        return self.mean_loss(loss), lr

    def loss_on(self, batch: dict[str, torch.Tensor]) -> float:
        """The model's loss on ``batch`` in evaluation mode, without training (one process: a
        rank of a grid gets its share)."""
        x, y = self._inputs(batch)
        self.model.eval()
        with torch.no_grad():
            loss = local_loss(self._forward(x), y, self.task, self.whole_voxels)
        self.model.train()
        return float(loss)

    def validate(self) -> dict[str, Any]:
        """Metrics of the validation set (module docstring); the same on every rank."""
        grid, timeout = self.grid, self.grid.timeout if self.grid else None
        reduce = grid is not None
        mean = self.target_sums.mean(None, timeout, reduce).to(self.run.device)
        channels = self.run.targets[1][0]
        model_err, base_err = Sums(channels, self.run.device), Sums(channels, self.run.device)
        identity = None
        if self.task == "voxel" and self.run.inputs[1][0] == channels:
            identity = Sums(channels, self.run.device)
        view = (1, channels, *[1] * (len(self.run.targets[1]) - 1))
        self.model.eval()
        with torch.no_grad():
            for batch in self.val_loader:
                x, y = self._inputs(batch)
                valid = batch.get("valid")
                pred = self._forward(x).float()
                model_err.add((pred - y).square(), valid)
                base_err.add((y - mean.view(view)).square(), valid)
                if identity is not None:
                    identity.add((x.float() - y).square(), valid)
        self.model.train()
        per_target = _ratio(model_err.reduced(None, timeout, reduce))
        baseline = _ratio(base_err.reduced(None, timeout, reduce))
        record = {
            "event": "validation", "step": self.step, "val_mse": float(per_target.mean()),
            "baseline_mse": float(baseline.mean()),
            "ratio": float(per_target.mean() / baseline.mean()),
            "val_mse_per_target": per_target.tolist(), "baseline_per_target": baseline.tolist(),
        }  # fmt: skip
        if identity is not None:
            record["identity_mse"] = float(_ratio(identity.reduced(None, timeout, reduce)).mean())
        return record

    # -- checkpoints ------------------------------------------------------------------------------
    def _own_optimizer(self) -> bool:
        """Whether each data rank keeps optimizer state of its own (``lion_cub``'s momenta)."""
        return isinstance(self.opt, LionCub) and self.grid is not None and self.grid.data_size > 1

    def save(self) -> str | None:
        """Write the checkpoint (rank 0; with ``lion_cub`` every data rank's momenta first).
        The first dense layer's weight, split by columns over the spatial group, and its
        optimizer state are gathered whole first (``trainer.dense``), by the ranks that write
        them: spatial rank 0 of data rank 0 (of every data rank for ``lion_cub``'s momenta)."""
        cfg, grid = self.cfg, self.grid
        first = grid is None or grid.data_rank == 0  # (a spatial group's collectives, or none)
        optimizer = None
        if first or self._own_optimizer():
            optimizer = whole_optimizer_state(self.model, self.opt)
        if self._own_optimizer():
            assert grid is not None
            if grid.spatial_rank == 0:  # (checkpoint.pt is still the last save's: keep its)
                state = {"step": self.step, "optimizer": optimizer}
                name = own_optimizer_name(grid.data_rank, self.step)
                save_checkpoint(cfg.checkpoint_dir, state, name)
                prune_own_optimizer(cfg.checkpoint_dir, grid.data_rank, {self.step, self.saved_at})
            self._world_sum(torch.zeros(1, device=self.run.device))  # every file is written
        rngs = self._rng_states()  # (collectives: before rank 0 alone goes on)
        targets, buffers = self._target_states(), self._buffer_states()
        model = whole_model_state(self.model) if first else None
        self.saved_at = self.step
        if not self.lead:  # the model is replicated (or gathered): rank 0 writes for all
            return None
        state = {
            "model": model, "optimizer": optimizer,
            "loader": self.loader.state_dict(), "rng": rngs, "step": self.step,
            "targets": targets, "buffers": buffers, "config": cfg.to_dict(),
            "world": 1 if grid is None else grid.world,
            "shapes": {"input": list(self.run.inputs[1]), "target": list(self.run.targets[1])},
        }  # fmt: skip
        return save_checkpoint(cfg.checkpoint_dir, state)

    def _rng_states(self) -> list[torch.Tensor]:
        """Every data rank's generator state, by data rank: the CPU's, then on a GPU the
        device's (dropout there draws from it), one byte tensor each (gathered over the data
        group; a replica's spatial ranks hold the same)."""
        own = torch.get_rng_state()
        if self.gpu:
            own = torch.cat([own, torch.cuda.get_rng_state(self.run.device)])
        if self.grid is None or self.grid.data_size == 1:
            return [own]
        every = all_gather(own.to(self.run.device), self.grid.data_group, self.grid.timeout)
        return [t.cpu() for t in every]

    def _target_states(self) -> list[dict[str, Any]]:
        """Every rank's target sums, by global rank: each rank sums its own samples (and with
        a voxel target its own block), and the baseline is their sum over the world."""
        own = self.target_sums.state_dict()
        if self.grid is None or self.grid.world == 1:
            return [own]
        packed = torch.cat([own["total"], own["total"].new_tensor([float(own["count"])])])
        every = all_gather(packed.to(self.run.device), None, self.grid.timeout)
        return [{"total": t[:-1].cpu(), "count": int(t[-1])} for t in every]

    def _buffer_states(self) -> list[dict[str, torch.Tensor]]:
        """Every data rank's model buffers (BatchNorm's running statistics, over its replica's
        samples alone), by data rank; a replica's spatial ranks hold the same."""
        own = dict(self.model.named_buffers())
        if self.grid is None or self.grid.data_size == 1:
            return [{k: v.cpu() for k, v in own.items()}]
        every: list[dict[str, torch.Tensor]] = [{} for _ in range(self.grid.data_size)]
        for name, value in own.items():
            for r, t in enumerate(all_gather(value, self.grid.data_group, self.grid.timeout)):
                every[r][name] = t.cpu()
        return every

    def resume(self) -> bool:
        """Load the checkpoint in ``checkpoint_dir`` if there is one. With ``lion_cub``'s own
        momenta it is mapped (``mmap``), so that its optimizer state, data rank 0's momenta,
        is never read (this rank's own file is) and the model's pages only while they are
        copied into the parameters: a rank's peak grew by the whole checkpoint and its own
        momenta (257 MiB at width 32), now by the model and its momenta."""
        directory = self.cfg.checkpoint_dir
        saved = load_checkpoint(directory, mmap=self._own_optimizer()) if directory else None
        if saved is None:
            return False
        try:
            self._load(saved)
        except ConfigError:
            raise
        except (RuntimeError, ValueError, KeyError) as exc:  # trainer.start.check_resume missed it
            why = str(exc).removeprefix("cannot resume: ")  # (the loader's own words)
            raise ConfigError(
                f"config key 'checkpoint_dir': cannot resume {self.cfg.checkpoint_dir}/"
                f"checkpoint.pt: {why}"
            ) from None
        return True

    def _load(self, saved: dict[str, Any]) -> None:
        self.model.load_state_dict(saved["model"])
        optimizer = saved["optimizer"]
        if self._own_optimizer():
            assert self.grid is not None
            own = load_own_optimizer(self.cfg.checkpoint_dir, self.grid.data_rank, saved["step"])
            if own is None:
                rank, step = self.grid.data_rank, saved["step"]
                raise ConfigError(own_optimizer_missing(self.cfg.checkpoint_dir, rank, step))
            optimizer = own["optimizer"]
        self.opt.load_state_dict(own_optimizer_state(self.model, self.opt, optimizer))
        self.loader.load_state_dict(saved["loader"])
        data_rank = 0 if self.grid is None else self.grid.data_rank
        own = _own_rng(saved, data_rank)
        if own is None:  # an older checkpoint kept rank 0's state alone: a stream of its own
            torch.manual_seed(dropout_seed(self.cfg.seed, data_rank, saved["step"]))
        else:
            cpu = torch.get_rng_state().numel()
            torch.set_rng_state(own[:cpu])
            if self.gpu and own.numel() > cpu:  # (a checkpoint of a CPU run: no device state)
                torch.cuda.set_rng_state(own[cpu:], self.run.device)
        buffers = saved.get("buffers")  # (an older checkpoint: rank 0's, in "model")
        if buffers is not None:
            self.model.load_state_dict(buffers[data_rank], strict=False)
        targets = saved["targets"]  # (an older checkpoint: rank 0's sums alone)
        rank = 0 if self.grid is None else self.grid.rank
        self.target_sums.load_state_dict(targets[rank] if isinstance(targets, list) else targets)
        self.step = self.resumed_from = self.saved_at = saved["step"]

    def close(self) -> None:
        self.loader.close()
        self.val_loader.close()
        if self.reducer is not None:
            self.reducer.remove()


def dropout_seed(seed: int, data_rank: int, *at: int) -> int:
    """The seed of data rank ``data_rank``'s dropout masks (below ``2**64``, as torch takes);
    ``at``: the step an older checkpoint is resumed from (its state was rank 0's)."""
    entropy = [seed, data_rank, *at]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])


def _own_rng(saved: dict[str, Any], data_rank: int) -> torch.Tensor | None:
    """Data rank ``data_rank``'s generator state in checkpoint ``saved``. One written before
    the data ranks drew their own dropout masks holds rank 0's alone (the device's apart):
    rank 0 resumes it exactly; ``None`` for the others (every rank had drawn alike)."""
    states = saved["rng"]
    if isinstance(states, list):
        return states[data_rank]
    if data_rank:
        return None
    return torch.cat([states, saved.get("cuda_rng", torch.empty(0, dtype=torch.uint8))])


def _ratio(sums: tuple[torch.Tensor, float]) -> torch.Tensor:
    """Per-channel mean squared error from ``Sums.reduced``."""
    total, count = sums
    return total / max(count, 1.0)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as ``cfg`` says; return ``{"steps", "losses" (this run's, averaged over the data
    ranks), "val_mse", "baseline_mse", "identity_mse", "resumed_from", "rank"}``."""
    run = start(cfg)
    return fit(Trainer(cfg, run))


AfterStep = Callable[[Trainer], dict[str, Any] | None]
"""Called after every step; a record it returns goes into the log."""


class StepRecords:
    """Step records whose losses are still on the device, until :meth:`read` reads them all at
    once (one host sync) and :meth:`write` logs them.

    Attributes:
        losses: every step's loss read so far (:meth:`Trainer.losses_of`).
    """

    def __init__(self, t: Trainer, log: Log) -> None:
        self.t, self.log = t, log
        self.pending: list[tuple[dict[str, Any], bool]] = []
        self.losses: list[float] = []

    def add(self, record: dict[str, Any], echo: bool) -> None:
        """Hold ``record``, whose ``"loss"`` is :meth:`Trainer.mean_loss`'s tensor."""
        self.pending.append((record, echo))

    def read(self) -> None:
        """Replace every held record's loss tensor by its value."""
        unread = [r for r, _ in self.pending if isinstance(r["loss"], torch.Tensor)]
        if unread:
            values = self.t.losses_of([r["loss"] for r in unread])
            for record, value in zip(unread, values, strict=True):
                record["loss"] = value
            self.losses += values

    def write(self) -> None:
        """Read and log every held record."""
        self.read()
        for record, echo in self.pending:
            self.log.write(record, echo=echo)
        self.pending = []


def fit(t: Trainer, after_step: AfterStep | None = None) -> dict[str, Any]:
    """Run ``t`` to its last step (the module docstring: resume, steps, validation, checkpoints,
    log), calling ``after_step(t)`` after every step; close ``t``. Returns :func:`train`'s
    dict."""
    cfg, run = t.cfg, t.run
    log = Log(cfg.log_file if t.lead else "", t.label)
    steps = StepRecords(t, log)
    last: dict[str, Any] = {}
    validated_at = checkpointed_at = None
    batches = timed_batches(t.loader)

    def validate() -> None:  # (once per step at most)
        nonlocal last, validated_at
        if validated_at != t.step:
            last, validated_at = t.validate(), t.step
            log.write(last, echo=t.lead)

    try:
        log.write(
            {"event": "start", "device": str(run.device), "backend": run.backend,
             "world": 1 if run.grid is None else run.grid.world, "spatial_parts": cfg.spatial_parts,
             "data_source": t.loader.source, "total_steps": run.total_steps}
        )  # fmt: skip
        if t.resume():
            log.write({"event": "resumed", "step": t.step})
            if t.lead:
                print(f"resumed from step {t.step}", flush=True)
        while t.step < run.total_steps:
            t0 = time.perf_counter()
            epoch = t.loader.epoch  # the batch's: handing out an epoch's last batch moves it on
            batch, wait = next(batches)
            if batch is None:  # an epoch ended
                steps.write()
                validate()  # (unless before its checkpoint)
                continue
            loss, lr = t.train_step(batch, epoch)
            record = {"step": t.step, "epoch": epoch, "loss": loss, "lr": lr}
            echo = t.lead and cfg.print_every > 0 and t.step % cfg.print_every == 0
            steps.add(record, echo)
            due = echo or t.step % cfg.log_every == 0
            if due:
                steps.read()  # waits for the device: this step's time includes it
            seconds = time.perf_counter() - t0
            record.update(samples_per_s=cfg.global_batch / seconds, data_wait=wait / seconds)
            if due:
                steps.write()
            extra = after_step(t) if after_step is not None else None
            if extra is not None:
                steps.write()
                log.write(extra)
            every = cfg.checkpoint_interval
            if cfg.checkpoint_dir and every and t.step % every == 0:
                steps.write()
                if t.loader.epoch != epoch:  # the epoch's last step: its validation first, so
                    validate()  # that a resume from this checkpoint has had it
                _checkpoint(t, log)
                checkpointed_at = t.step
        batches.close()
        steps.write()
        validate()
        if cfg.checkpoint_dir and checkpointed_at != t.step:
            _checkpoint(t, log)
    finally:
        with contextlib.suppress(Exception):
            batches.close()
        with contextlib.suppress(Exception):  # the steps done before a failure
            steps.write()
        log.close()
        t.close()
    return {
        "steps": t.step, "losses": steps.losses, "val_mse": last.get("val_mse", float("nan")),
        "baseline_mse": last.get("baseline_mse", float("nan")),
        "identity_mse": last.get("identity_mse"), "resumed_from": t.resumed_from,
        "rank": 0 if run.grid is None else run.grid.rank,
    }  # fmt: skip


def _checkpoint(t: Trainer, log: Log) -> None:
    path = t.save()
    if path is not None:
        log.write({"event": "checkpoint", "step": t.step, "path": path})

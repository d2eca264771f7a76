"""Starting a run: the rank's device and backend, the process group, and every check before any
layer communicates, agreed on by all ranks.

:func:`start` picks the device and backend (``trainer.devices``), starts ``torch.distributed``
when the run is distributed (a launcher's variables, an initialized group, or a spatial split),
then checks on every rank: GPUs per node for NCCL, the datasets and their fields (asked of
``datastore serve`` when the data comes from it: a sharded dataset is whole only there), the world
against ``spatial_parts``, the model's blocks at every level (``trainer.preflight``), the global
batch against the data ranks and the dataset, the learning-rate schedule, the output paths
(:func:`check_paths`; rank 0 holds ``checkpoint_dir``, refused while another run holds it) and
a checkpoint it would resume (:func:`check_resume`). The ranks then
agree (``datastore.ranks.agree``: one round of small messages with a deadline) on the outcome and on
the configuration itself: one rank's failure, or ranks started with different configurations,
is the same :class:`~trainer.config.ConfigError` on every rank. Only then is the
:class:`~trainer.grid.ProcessGrid` created. A tournament's ranks (``trainer.tournament``) are
trainers of their own: each checks one process's run, and there is no grid.
"""

from __future__ import annotations

import datetime
import json
import os
import zipfile
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from datastore.errors import (
    DatasetNotFound,
    DataStoreError,
    ExchangeTimeout,
    PathNotAllowed,
    PeerFailed,
)
from datastore.ranks.agree import Collective, agree
from datastore.readers import DatasetError
from datastore.sources.describe import describe_dataset, hold_datasets
from datastore.sources.options import ServiceOptions
from datastore.store.memory import available_memory
from staging.cluster import launched_by_mpi, local_rank, local_size, torchrun_world
from trainer.checkpoint import (
    CHECKPOINT_NAME,
    hold_directory,
    load_checkpoint,
    load_own_optimizer,
    own_optimizer_missing,
    own_optimizer_name,
)
from trainer.config import ConfigError, TournamentConfig, TrainConfig, trainer_log
from trainer.devices import check_gpus, pick_backend, pick_device, ranks_on_device
from trainer.grid import ProcessGrid, init_distributed
from trainer.optim import LRSchedule
from trainer.preflight import (
    check_memory,
    check_run,
    check_world,
    model_parameters,
    optimizer_copies,
    rank_parameters,
)

__all__ = [
    "RESUME_KEYS", "Field", "Run", "check_paths", "check_resume", "data_address", "data_paths",
    "data_token", "describe", "field_of", "make_resident", "memory_of", "schedule_of", "start",
]  # fmt: skip

Field = tuple[str, tuple[int, ...], tuple[int, ...]]
"""``(name, per-sample shape, spatial axes)``."""


@dataclass(frozen=True)
class Run:
    """What :func:`start` settled.

    Attributes:
        device: this rank's device.
        backend: the process group's backend (``"gloo"`` also without a group).
        grid: the process grid; ``None`` for one plain process.
        depth: the model's poolings.
        inputs, targets: the input and target fields.
        samples: training samples.
        total_steps: steps of the whole run.
    """

    device: torch.device
    backend: str
    grid: ProcessGrid | None
    depth: int
    inputs: Field
    targets: Field
    samples: int
    total_steps: int


def data_paths(cfg: TrainConfig) -> tuple[str, str]:
    """The training and validation datasets (``train_file``/``validation_file`` under ``data``)."""
    return os.path.join(cfg.data, cfg.train_file), os.path.join(cfg.data, cfg.validation_file)


def data_address(cfg: TrainConfig) -> str | None:
    """Where ``datastore serve`` runs: ``data_address``, else ``$DATASTORE_ADDRESS``, else
    ``None`` (the embedded loader)."""
    return cfg.data_address or os.environ.get("DATASTORE_ADDRESS") or None


def data_token(cfg: TrainConfig) -> str | None:
    """The token of a TCP ``datastore serve``, read from ``data_token_file`` (``None``: none).

    Raises:
        ValueError: naming the config key, when the file cannot be read or is empty.
    """
    if not cfg.data_token_file:
        return None
    from datastore.service.auth import read_token

    try:
        return read_token(cfg.data_token_file)[0]
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise ValueError(f"config key 'data_token_file': {cfg.data_token_file}: {why}") from None


def describe(
    path: str, address: str | None, timeout: float, token: str | None = None
) -> tuple[dict[str, Field], int]:
    """``({name: Field}, samples)`` of the dataset at ``path``: opened here, or asked of the
    service at ``address``, which sees the whole dataset where this node holds only its share
    (``datastore stage --mode shard``)."""
    service = ServiceOptions(address, token=token) if address is not None else None
    try:
        samples, info = describe_dataset(path, service, timeout=timeout)
    except DataStoreError as exc:
        if service is None:
            raise
        raise _service_refused(exc) from None
    return {name: (name, f.shape, f.spatial_axes) for name, f in info.items()}, samples


def _service_refused(exc: DataStoreError) -> ValueError:
    """The service's refusal, blaming the key at fault: ``data`` for a path it has no dataset
    at or may not read, ``data_address`` for the service (not there, not answering, ...)."""
    key = "data" if isinstance(exc, DatasetNotFound | PathNotAllowed) else "data_address"
    return ValueError(f"config key {key!r}: {exc}")


def _dataset(
    key: str, path: str, address: str | None, timeout: float, token: str | None
) -> tuple[dict[str, Field], int]:
    """:func:`describe` of the dataset config keys ``data`` and ``key`` name: a file read here
    that is missing or unreadable names them (a service's refusal names its key already)."""
    try:
        return describe(path, address, timeout, token)
    except DatasetError as exc:
        raise ValueError(f"config keys 'data', {key!r}: {exc}") from None


def field_of(fields: dict[str, Field], name: str, what: str, path: str) -> Field:
    """Field ``name`` of the dataset at ``path`` whose fields are ``fields``.

    Raises:
        ValueError: naming the dataset and the fields it has, when ``name`` is not one.
    """
    if name not in fields:
        raise ValueError(
            f"{what} field {name!r} is not in {path} (its fields: {', '.join(fields)})"
        )
    return fields[name]


def run_steps(steps: int, epochs: int, samples: int, global_batch: int) -> int:
    """A run's steps: ``steps``, else ``epochs`` epochs of ``samples // global_batch``."""
    return steps or epochs * (samples // global_batch)


def schedule_of(cfg: TrainConfig, total_steps: int) -> LRSchedule:
    """The learning-rate schedule of ``cfg`` over ``total_steps``."""
    return LRSchedule(
        cfg.lr, global_batch=cfg.global_batch, base_batch=cfg.base_batch or cfg.global_batch,
        warmup_steps=cfg.warmup, total_steps=total_steps, decay=cfg.lr_schedule,
        final_lr=cfg.final_lr,
    )  # fmt: skip


def _check(cfg: TrainConfig, world: int, device: torch.device, backend: str, gpus: int):
    """Every check of the module docstring; ``(depth, inputs, targets, samples, total)``."""
    here = local_size()
    check_gpus(backend, device, ranks_per_node=here, gpus=gpus)
    train_path, val_path = data_paths(cfg)
    address, token = data_address(cfg), data_token(cfg)
    timeout = cfg.comm_timeout
    train_fields, samples = _dataset("train_file", train_path, address, timeout, token)
    val_fields, val_samples = _dataset("validation_file", val_path, address, timeout, token)
    if not val_samples:
        raise ValueError(f"config key 'validation_file': {val_path} has no samples")
    inputs = field_of(train_fields, cfg.input_field, "input", train_path)
    targets = field_of(train_fields, cfg.target_field, "target", train_path)
    for field, what in ((inputs, "input"), (targets, "target")):
        other = field_of(val_fields, field[0], what, val_path)
        if other[1] != field[1]:
            raise ValueError(
                f"{what} field {field[0]!r}: {val_path} has shape {other[1]}, {train_path} "
                f"{field[1]}"
            )
    depth = check_run(cfg.model, inputs, targets, cfg.spatial_parts, cfg.conv_blocks, world)
    shape = (cfg.model, inputs[1][0], targets[1][0], inputs[1][1], cfg.width, depth)
    params = model_parameters(*shape)
    on_rank = rank_parameters(*shape, tuple(cfg.spatial_parts))
    copies = optimizer_copies(cfg.optimizer, cfg.momentum)
    check_memory(
        cfg.model,
        cfg.width,
        depth,
        params,
        cfg.optimizer,
        copies,
        str(device),
        *memory_of(device),
        on_rank=on_rank,
        buckets=world > 1,
        device_ranks=ranks_on_device(cfg.device, device, gpus=gpus, ranks_per_node=here),
        host_ranks=here,
    )
    data_ranks = check_world(world, cfg.spatial_parts)
    if cfg.global_batch % data_ranks:
        raise ValueError(
            f"config key 'global_batch': {cfg.global_batch} samples do not split evenly over "
            f"{data_ranks} data-parallel ranks"
        )
    if cfg.global_batch > samples:
        raise ValueError(
            f"config key 'global_batch': {cfg.global_batch} is more than the {samples} "
            f"training samples in {train_path}"
        )
    total = run_steps(cfg.steps, cfg.epochs, samples, cfg.global_batch)
    try:
        schedule_of(cfg, total)
    except ValueError as exc:  # a decay needs more steps than the warm-up
        raise ValueError(f"config keys 'lr_schedule', 'warmup', 'steps': {exc}") from None
    check_resume(cfg, world, samples, inputs, targets)
    return depth, inputs, targets, samples, total


def memory_of(device: torch.device) -> tuple[int | None, int | None]:
    """``(bytes device can still hold, bytes the host can)``: a GPU's free memory, else the
    host's available memory (``datastore.store.memory.available_memory``); ``None``: unknown."""
    host = available_memory()
    if device.type != "cuda":
        return host, host
    try:
        free = torch.cuda.mem_get_info(device)[0]
    except Exception:  # no answer is no check, never a refused run
        try:
            free = torch.cuda.get_device_properties(device).total_memory
        except Exception:
            free = None
    return free, host


RESUME_KEYS = (
    "model", "width", "conv_blocks", "optimizer", "input_field", "target_field", "global_batch",
    "seed", "spatial_parts", "dropout", "lr", "base_batch", "warmup", "lr_schedule", "final_lr",
    "momentum", "weight_decay",
)  # fmt: skip
"""The config keys a resumed run must share with the run that wrote its checkpoint: they shape
the model's and the optimizer's state, the sample sequence, or the steps' updates. (The run's
length, ``steps`` or ``epochs``, may change where the learning rate does not depend on it.)"""


def check_resume(cfg: TrainConfig, world: int, samples: int, inputs: Field, targets: Field) -> None:
    """Refuse a checkpoint in ``checkpoint_dir`` that this run cannot resume: unreadable,
    written with other :data:`RESUME_KEYS`, by another number of ranks, for samples of other
    shapes, or over another number of steps where the learning-rate schedule spans the run (a
    decay, not ``constant``: its rate at every step left would change). ``samples``,
    ``inputs``, ``targets``: the training set's sample count and fields.

    Raises:
        ValueError: naming the checkpoint and what differs.
    """
    path = os.path.join(cfg.checkpoint_dir, CHECKPOINT_NAME) if cfg.checkpoint_dir else ""
    if not path or not os.path.exists(path):
        return
    bad = f"config key 'checkpoint_dir': {path} is not a checkpoint of this trainer"
    fix = "move it away or choose another checkpoint_dir"
    if not zipfile.is_zipfile(path):  # what torch.save writes
        raise ValueError(f"{bad} (not a file torch.save wrote); {fix}")
    try:
        saved = load_checkpoint(cfg.checkpoint_dir, mmap=True) or {}
        config, saved_world = dict(saved["config"]), saved.get("world")
    except Exception as exc:  # torch.load raises many kinds on a file that is not its own
        raise ValueError(f"{bad} ({type(exc).__name__}: {exc}); {fix}") from None
    now = cfg.to_dict()
    differ = [
        f"{key}={config.get(key)!r} (now {now[key]!r})"
        for key in RESUME_KEYS
        if config.get(key) != now[key]
    ]
    if saved_world is not None and saved_world != world:
        differ.append(f"{saved_world} rank(s) (now {world})")
    position = saved.get("loader")  # (the loader refuses it too, but on each rank, mid-start)
    if isinstance(position, dict) and position.get("num_samples") not in (None, samples):
        differ.append(f"{position['num_samples']} training samples (now {samples})")
    shapes = saved.get("shapes")  # (an older checkpoint has none: loading its model refuses)
    for what, (name, shape, _) in (("input", inputs), ("target", targets)):
        if shapes is not None and tuple(shapes[what]) != tuple(shape):
            differ.append(f"{what} {name!r} of shape {tuple(shapes[what])} (now {tuple(shape)})")
    if cfg.lr_schedule != "constant" and not differ:
        was = run_steps(config.get("steps", 0), config.get("epochs", 1), samples, cfg.global_batch)
        total = run_steps(cfg.steps, cfg.epochs, samples, cfg.global_batch)
        if was != total:
            differ.append(
                f"lr_schedule={cfg.lr_schedule!r} over {was} steps (now {total}: the rate of "
                "every step left would change)"
            )
    if differ:
        raise ValueError(
            f"config key 'checkpoint_dir': cannot resume {path}: it was written with "
            f"{', '.join(differ)}; resume with the same settings or choose another "
            "checkpoint_dir"
        )
    data_ranks = check_world(world, cfg.spatial_parts)
    if cfg.optimizer == "lion_cub" and data_ranks > 1:  # each data rank's momenta, its own file
        for r in range(data_ranks):
            name = own_optimizer_name(r, saved.get("step"))
            try:
                own = load_own_optimizer(cfg.checkpoint_dir, r, saved.get("step"), mmap=True)
            except Exception as exc:  # (as above: not a file torch.save wrote)
                raise ValueError(f"{bad} ({name}: {type(exc).__name__}: {exc}); {fix}") from None
            if own is None:
                raise ValueError(own_optimizer_missing(cfg.checkpoint_dir, r, saved.get("step")))


def check_paths(cfg: TrainConfig, logs: list[str]) -> None:
    """Refuse a ``checkpoint_dir`` that cannot be created or written, and log files (``logs``:
    those this rank writes) that cannot be appended to, before any step is spent.

    Raises:
        ValueError: naming the config key and the path.
    """
    if cfg.checkpoint_dir:
        _writable_dir("checkpoint_dir", cfg.checkpoint_dir)
    for log in logs:
        if os.path.isdir(log):
            raise ValueError(f"config key 'log_file': {log} is a directory")
        if os.path.exists(log) and not os.access(log, os.W_OK):
            raise ValueError(f"config key 'log_file': {log} is not writable")
        _writable_dir("log_file", os.path.dirname(log) or ".")  # made when missing


def _writable_dir(key: str, path: str) -> None:
    """``path`` is a writable directory, or can be made one (its first existing ancestor is)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"config key {key!r}: {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"config key {key!r}: {path}: {probe} is not writable")


def _check_tournament(tc: TournamentConfig, world: int, distributed: bool) -> None:
    """A tournament's own checks: one process per trainer, a held-out batch that fits."""
    k = tc.trainers
    if not distributed:
        raise ValueError(
            f"a tournament of {k} trainers runs one process per trainer: launch {k} "
            f"(mpiexec -n {k} python -m mpi4py -m trainer tournament ..., or torchrun "
            f"--nproc-per-node {k} -m trainer tournament ...)"
        )
    if world != k:
        raise ValueError(
            f"config key 'tournament.trainers': {k} trainers but {world} processes were "
            "launched (one process per trainer)"
        )
    _, val_path = data_paths(tc.train)
    address, token = data_address(tc.train), data_token(tc.train)
    fields, samples = describe(val_path, address, tc.train.comm_timeout, token)
    field_of(fields, tc.train.input_field, "input", val_path)
    batch = tc.holdout_batch or tc.train.global_batch
    if batch > samples:
        raise ValueError(
            f"config key 'tournament.holdout_batch': a held-out batch of {batch} is more than "
            f"the {samples} validation samples in {val_path}"
        )
    make_resident(address or "", data_paths(tc.train), tc.train.comm_timeout, token)


def make_resident(
    address: str, paths: tuple[str, ...], timeout: float, token: str | None = None
) -> None:
    """Ask ``datastore serve`` at ``address`` to hold the datasets at ``paths`` and wait until
    they are in memory (at most ``timeout`` seconds each): ranks that then open sessions start
    on memory, and each sample is read from disk once, not by several sessions at a time. The
    first caller starts the load; the others wait for the same one.

    Raises:
        ValueError: the service's refusal (not running, a path outside its roots, ...).
    """
    try:
        hold_datasets(paths, ServiceOptions(address, token=token), timeout=timeout)
    except DataStoreError as exc:
        raise _service_refused(exc) from None


def _agree(cfg: TrainConfig, error: BaseException | None, fingerprint: dict[str, Any]) -> None:
    """Raise the same ``ConfigError`` on every rank if any rank failed or configs differ."""
    if launched_by_mpi():
        from mpi4py import MPI

        coll, group = Collective(comm=MPI.COMM_WORLD), None
    else:
        group = dist.new_group(backend="gloo")  # small CPU messages, whatever the backend
        coll = Collective(group=group)
    fingerprint = _per_key(fingerprint)
    try:
        agree(coll, fingerprint, error, cfg.comm_timeout, "the trainer's start-up check")
    except (ExchangeTimeout, PeerFailed) as exc:  # (some rank not heard from)
        raise ConfigError(str(exc)) from None
    except (ValueError, OSError, RuntimeError) as exc:  # every rank raises it
        raise ConfigError(str(exc), everywhere=True) from None
    finally:
        coll.close()
        if group is not None:
            dist.destroy_process_group(group)


def _per_key(config: dict[str, Any]) -> dict[str, str]:
    """``config`` (``to_dict()``; a tournament's training keys under ``"train"``) as one
    fingerprint entry per config key, so that ranks that disagree are told which key differs
    (one entry for the whole configuration named none: two 700-character configurations)."""
    keys = {k: v for k, v in config.items() if k != "train"}
    if "train" in config:  # a tournament's
        keys = {**config["train"], **{f"tournament.{k}": v for k, v in keys.items()}}
    return {f"config key {k!r}": json.dumps(v, sort_keys=True) for k, v in keys.items()}


def start(cfg: TrainConfig, tournament: TournamentConfig | None = None) -> Run:
    """Pick the device, start the process group and the grid, check everything (module
    docstring).

    With ``tournament`` (``cfg`` is its ``train``) every rank is a trainer of its own: the
    checks are one process's, plus the tournament's (one process per trainer), the ranks
    agree on the tournament's configuration, and there is no grid.

    Raises:
        ConfigError: on every rank alike, naming what cannot work.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    error: BaseException | None = None
    device, backend = torch.device("cpu"), "gloo"
    try:
        device = pick_device(cfg.device, gpus=gpus, local_rank=local_rank())
        backend = pick_backend(cfg.backend, device)
    except ValueError as exc:
        error = exc
    launched = launched_by_mpi() or torchrun_world() is not None
    distributed = launched or dist.is_initialized() or cfg.spatial_parts != (1, 1, 1)
    timeout = datetime.timedelta(seconds=cfg.comm_timeout)
    if distributed:
        init_distributed(backend, timeout=timeout, device=device)
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    found: Any = None
    if error is None:
        try:
            if tournament is not None:
                logs = [trainer_log(cfg.log_file, rank)] + ([cfg.log_file] if rank == 0 else [])
                check_paths(cfg, [log for log in logs if log])
                _check_tournament(tournament, world, distributed)
            else:
                check_paths(cfg, [cfg.log_file] if cfg.log_file and rank == 0 else [])
                if cfg.checkpoint_dir and rank == 0:
                    hold_directory(cfg.checkpoint_dir)
            found = _check(cfg, 1 if tournament else world, device, backend, gpus)
            if tournament is not None and found[4] < tournament.interval:
                raise ValueError(
                    f"config key 'tournament.interval': rounds every {tournament.interval} "
                    f"steps, but each trainer trains {found[4]} steps: no round would be played"
                )
        except (ValueError, OSError) as exc:
            error = exc
    if distributed:
        _agree(cfg, error, (tournament or cfg).to_dict())
    elif error is not None:
        raise ConfigError(str(error)) from None
    grid = None
    if distributed and tournament is None:
        grid = ProcessGrid.create(cfg.spatial_parts, timeout=timeout)
    depth, inputs, targets, samples, total = found
    return Run(device, backend, grid, depth, inputs, targets, samples, total)

"""The training configuration: one typed, frozen dataclass, loaded from TOML plus overrides.

A config file is flat TOML whose keys are the fields of :class:`TrainConfig`::

    data = "cosmo32"            # directory with train.h5 and validation.h5
    model = "cosmoflow"         # or "unet3d"
    width = 8
    epochs = 20
    global_batch = 16
    lr = 1e-3
    optimizer = "adam"

``--set key=value`` overrides a key; the value is read as a TOML value (``lr=1e-3``,
``spatial_parts=[1,1,1]``), or taken as a plain string for a string key (``optimizer=sgd``).
An unknown key, a value of the wrong type or out of range (NaN and infinities included) raises
:class:`ConfigError` naming the key. Paths are taken relative to the working directory.

A tournament (:class:`TournamentConfig`, ``python -m trainer tournament``) reads the same file
with a ``[tournament]`` table (``trainers``, ``interval``, ``lrs``, ``seed``,
``holdout_batch``), overridden with ``--set tournament.KEY=VALUE``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from trainer.devices import BACKENDS
from trainer.model_table import MODELS
from trainer.optim import DECAYS

__all__ = [
    "MODELS",
    "OPTIMIZERS",
    "ConfigError",
    "TournamentConfig",
    "TrainConfig",
    "load_config",
    "load_tournament",
    "parse_override",
]

OPTIMIZERS = ("sgd", "adam", "lars", "lion", "lion_cub")
MOMENTUM_OPTIMIZERS = ("sgd", "lars")  # the optimizers config key 'momentum' applies to
MOMENTUM = 0.9  # its default


class ConfigError(ValueError):
    """A bad configuration; the message names the key. ``everywhere``: every rank of the job
    raised it alike (they agreed on it), so they may end together."""

    def __init__(self, message: str, everywhere: bool = False) -> None:
        super().__init__(message)
        self.everywhere = everywhere


@dataclass(frozen=True)
class TrainConfig:
    """What to train, on what, and how.

    Args:
        data: directory holding the datasets (``trainer.cosmology`` writes ``train.h5`` and
            ``validation.h5``).
        train_file, validation_file: the training and validation datasets, relative to
            ``data`` (or absolute); any format ``datastore`` reads. Default: ``"train.h5"``,
            ``"validation.h5"``.
        input_field, target_field: the fields the model reads and predicts. The input has a
            channel axis and 3 spatial axes; the target is a vector per sample for
            ``cosmoflow``, a volume of the input's spatial shape for ``unet3d``. Default:
            ``"x"``, ``"y"``.
        model: a name in :data:`MODELS` (``trainer.model_table``): ``cosmoflow`` regresses the
            target vector, ``unet3d`` predicts the target volume voxel by voxel.
            Default: ``"cosmoflow"``.
        width: filters of the first level (CosmoFlow's ``conv_size``, the U-Net's ``base``).
            Default: ``8``.
        conv_blocks: CosmoFlow's convolution blocks or the U-Net's poolings (``0``: CosmoFlow
            ``min(5, log2(side))``, U-Net ``min(3, log2(side) - 2)``); each halves the side,
            and with a spatial split every block must keep at least 2 voxels per split axis
            before each pooling (checked before training). Default: ``0``.
        dropout: dropout after CosmoFlow's dense hidden layers (refused for a model without
            dropout layers). Default: ``0.0``.
        epochs: passes over the training set. Default: ``1``.
        steps: stop after this many steps in all (``0``: ``epochs`` full epochs). Default: ``0``.
        global_batch: samples per step over all data-parallel ranks. Default: ``16``.
        lr: peak learning rate (at ``base_batch``, scaled linearly to ``global_batch``).
            Default: ``1e-3``.
        base_batch: the batch ``lr`` was tuned for (``0``: ``global_batch``, no scaling).
            Default: ``0``.
        warmup: steps of linear warm-up to the peak. Default: ``0``.
        lr_schedule: after the warm-up, ``constant``, ``linear`` or ``cosine`` decay toward
            ``final_lr``, reached at step ``total`` (one past the last, as torch's
            ``CosineAnnealingLR`` with ``T_max`` the run's steps: the last step trains a
            little above it; ``trainer.optim.lr_at``). Default: ``"constant"``.
        final_lr: the learning rate the decay tends to. Default: ``0.0``.
        optimizer: one of :data:`OPTIMIZERS`. Default: ``"adam"``.
        momentum: SGD and LARS momentum (another value with another optimizer is refused).
            Default: ``0.9``.
        weight_decay: L2 penalty. Default: ``0.0``.
        seed: model initialisation, shuffling, and dropout (a stream per data rank, from
            ``seed`` and the rank) (0 to ``2**64 - 1``). Default: ``0``.
        spatial_parts: blocks per spatial axis of every sample; their product must divide the
            number of ranks, the rest are data-parallel replicas. Default: ``(1, 1, 1)``.
        device: ``auto`` (the rank's GPU if CUDA is available, else the CPU), ``cpu``, ``cuda``
            or ``cuda:N`` (``trainer.devices``). Default: ``"auto"``.
        backend: ``auto`` (NCCL on GPUs, gloo on CPUs), ``nccl`` or ``gloo`` (on GPUs: ranks
            may share a GPU, messages staged through host memory). Default: ``"auto"``.
        amp: bf16 autocast of the forward pass on a GPU (ignored on the CPU). Default: ``True``.
        channels_last: the ``channels_last_3d`` memory format on a GPU. Default: ``True``.
        cudnn_benchmark: let cuDNN pick the fastest convolution algorithms. Default: ``True``.
        tf32: float32 convolutions and matmuls on a GPU may run in TF32 (10-bit mantissa, much
            faster); ``False`` for float32 really, as equivalence checks need. Default: ``True``.
        halo_overlap: split convolutions compute their interior while the halo travels
            (``DistConv3d(overlap=...)``; measured on the CPU at side 64: the step 10% shorter,
            peak memory per rank 0.58x of the whole sample at a 2-way split instead of 0.54x).
            Default: ``True``.
        checkpoint_dir: where ``checkpoint.pt`` is written and resumed from (``""``: never).
            Default: ``""``.
        checkpoint_interval: steps between checkpoints (``0``: only at the end; refused without
            ``checkpoint_dir``). Default: ``0``.
        log_file: JSON-lines log, appended to (``""``: none). Default: ``""``.
        print_every: rank 0 also prints every this many steps' log record (``0``: never).
            Default: ``0``.
        log_every: the steps' losses stay on the device and are read (all at once, one host
            sync) and their log records written every this many steps, at a printed step and
            before any other record; the values are those of every step. Default: ``10``.
        comm_timeout: seconds a collective or halo receive may wait before the rank fails
            (a peer died or stalled; at most a year). Default: ``120.0``.
        data_address: stream the training batches from ``datastore serve`` at this address
            (socket path, ``unix://PATH`` or ``HOST:PORT``; ``""``: ``$DATASTORE_ADDRESS`` if
            set, else read them here with the embedded loader). The datasets' fields and sample
            counts are then asked of the service too. Default: ``""``.
        data_token_file: the file holding the token of a TCP ``datastore serve`` (the file
            its ``--token-file`` names; ``""``: none). Default: ``""``.
    """

    data: str
    train_file: str = "train.h5"
    validation_file: str = "validation.h5"
    input_field: str = "x"
    target_field: str = "y"
    model: str = "cosmoflow"
    width: int = 8
    conv_blocks: int = 0
    dropout: float = 0.0
    epochs: int = 1
    steps: int = 0
    global_batch: int = 16
    lr: float = 1e-3
    base_batch: int = 0
    warmup: int = 0
    lr_schedule: str = "constant"
    final_lr: float = 0.0
    optimizer: str = "adam"
    momentum: float = MOMENTUM
    weight_decay: float = 0.0
    seed: int = 0
    spatial_parts: tuple[int, int, int] = (1, 1, 1)
    device: str = "auto"
    backend: str = "auto"
    amp: bool = True
    channels_last: bool = True
    cudnn_benchmark: bool = True
    tf32: bool = True
    halo_overlap: bool = True
    checkpoint_dir: str = ""
    checkpoint_interval: int = 0
    log_file: str = ""
    print_every: int = 0
    log_every: int = 10
    comm_timeout: float = 120.0
    data_address: str = ""
    data_token_file: str = ""

    def __post_init__(self) -> None:
        _coerce_fields(self)
        if not self.data:
            raise ConfigError("config key 'data': must name the dataset directory")
        _choice("model", self.model, MODELS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_schedule", self.lr_schedule, DECAYS)
        _choice("backend", self.backend, BACKENDS)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(
                f"config key 'device': {self.device!r} is not one of auto, cpu, cuda, cuda:N"
            )
        for key in ("train_file", "validation_file", "input_field", "target_field"):
            if not getattr(self, key):
                raise ConfigError(f"config key {key!r}: must not be empty")
        if self.input_field == self.target_field:  # (the loader reads a field once per batch)
            raise ConfigError(
                f"config keys 'input_field', 'target_field': both name field "
                f"{self.input_field!r}; the model predicts another field than it reads"
            )
        for key in ("width", "epochs", "global_batch", "log_every"):
            _at_least(key, getattr(self, key), 1)
        for key in (
            "steps", "warmup", "checkpoint_interval", "conv_blocks", "print_every", "base_batch"
        ):  # fmt: skip
            _at_least(key, getattr(self, key), 0)
        for key in ("lr", "momentum", "weight_decay", "dropout", "final_lr"):
            _at_least(key, getattr(self, key), 0)
        _seed("seed", self.seed)
        if not 0 < self.comm_timeout <= COMM_TIMEOUT_MAX:
            raise ConfigError(
                f"config key 'comm_timeout': must be positive and at most {COMM_TIMEOUT_MAX:.0f} "
                f"seconds (a year), got {self.comm_timeout:g}"
            )
        if self.lr <= 0:
            raise ConfigError(f"config key 'lr': must be positive, got {self.lr}")
        if self.dropout >= 1:
            raise ConfigError(f"config key 'dropout': must be below 1, got {self.dropout}")
        self._refuse_ignored()

    def _refuse_ignored(self) -> None:
        """Refuse a setting this configuration would ignore (a silent no-op is a wrong run)."""
        if self.dropout and not MODELS[self.model].dropout:
            raise ConfigError(
                f"config key 'dropout': model {self.model!r} has no dropout layers; leave "
                f"dropout at 0 (got {self.dropout})"
            )
        if self.momentum != MOMENTUM and self.optimizer not in MOMENTUM_OPTIMIZERS:
            raise ConfigError(
                f"config key 'momentum': optimizer {self.optimizer!r} takes no momentum (only "
                f"{' and '.join(MOMENTUM_OPTIMIZERS)} do); leave it out (got {self.momentum})"
            )
        if self.checkpoint_interval and not self.checkpoint_dir:
            raise ConfigError(
                f"config key 'checkpoint_interval': {self.checkpoint_interval} steps, but "
                "checkpoint_dir is empty, so no checkpoint would be written; set "
                "checkpoint_dir, or checkpoint_interval=0"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (tuples as lists), as written into checkpoints and logs."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }


@dataclass(frozen=True)
class TournamentConfig:
    """A tournament of trainers (``python -m trainer tournament``, ``trainer.tournament``).

    In a config file these keys sit in a ``[tournament]`` table beside the training keys; on
    the command line they are ``--set tournament.KEY=VALUE``.

    Args:
        train: what every trainer trains; trainer ``k`` takes learning rate ``lrs[k]`` and
            seed ``train.seed + k`` (its initial weights and its shuffle).
        trainers: trainers in the tournament, one process each (the launcher's world size).
            Default: ``2``.
        interval: steps between rounds; a round follows every ``interval``-th step. Default:
            ``10``.
        lrs: each trainer's peak learning rate (``()``: ``train.lr`` for all). Default: ``()``.
        seed: the pairing of every round and the order of the held-out batches (0 to
            ``2**64 - 1``). Default: ``0``.
        holdout_batch: samples of a round's held-out batch, drawn from the validation split
            (``0``: ``train.global_batch``). Default: ``0``.
    """

    train: TrainConfig
    trainers: int = 2
    interval: int = 10
    lrs: tuple[float, ...] = ()
    seed: int = 0
    holdout_batch: int = 0

    def __post_init__(self) -> None:
        _coerce_fields(self, prefix="tournament.", skip=("train",))
        if self.trainers < 2:
            raise ConfigError(
                f"config key 'tournament.trainers': a tournament needs at least 2 trainers, "
                f"got {self.trainers}"
            )
        if self.interval < 1:
            raise ConfigError(
                f"config key 'tournament.interval': rounds must be at least 1 step apart, "
                f"got {self.interval}"
            )
        if self.lrs and len(self.lrs) != self.trainers:
            raise ConfigError(
                f"config key 'tournament.lrs': {len(self.lrs)} learning rates for "
                f"{self.trainers} trainers (give one per trainer, or none)"
            )
        if any(lr <= 0 for lr in self.lrs):
            raise ConfigError(f"config key 'tournament.lrs': must be positive, got {self.lrs}")
        _at_least("tournament.holdout_batch", self.holdout_batch, 0)
        _seed("tournament.seed", self.seed)
        t = self.train
        if t.seed + self.trainers - 1 > SEED_MAX:
            raise ConfigError(
                f"config key 'seed': trainer k takes seed + k, and seed {t.seed} + "
                f"{self.trainers - 1} is more than {SEED_MAX}"
            )
        if not (t.data_address or os.environ.get("DATASTORE_ADDRESS")):
            raise ConfigError(
                "config key 'data_address': a tournament's trainers read through one "
                "`datastore serve`; set it (or DATASTORE_ADDRESS) to the service's address"
            )
        if t.spatial_parts != (1, 1, 1):
            raise ConfigError(
                f"config key 'spatial_parts': each trainer of a tournament is one process, "
                f"so it cannot split samples; got {list(t.spatial_parts)}"
            )
        if t.checkpoint_dir:  # (an empty one with an interval is refused as a training's)
            also = ", and checkpoint_interval=0" if t.checkpoint_interval else ""
            raise ConfigError(
                "config key 'checkpoint_dir': a tournament does not checkpoint (it cannot "
                f"resume yet); leave it empty{also}"
            )

    def trainer_config(self, k: int) -> TrainConfig:
        """Trainer ``k``'s configuration: its learning rate, its seed and its own log."""
        return dataclasses.replace(
            self.train, lr=self.lrs[k] if self.lrs else self.train.lr, seed=self.train.seed + k,
            log_file=trainer_log(self.train.log_file, k),
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """Plain data (tuples as lists), the training keys under ``"train"``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["train"], out["lrs"] = self.train.to_dict(), list(self.lrs)
        return out


def trainer_log(path: str, k: int) -> str:
    """Trainer ``k``'s log beside ``path``: ``run.jsonl`` gives ``run.t1.jsonl``."""
    if not path:
        return ""
    root, ext = os.path.splitext(path)
    return f"{root}.t{k}{ext}"


def _types(cls: type = TrainConfig) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce_fields(obj: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> None:
    """Coerce every field of dataclass ``obj`` to its annotated type (``ConfigError``)."""
    types = _types(type(obj))
    for f in dataclasses.fields(obj):
        if f.name not in skip:
            value = _coerce(prefix + f.name, getattr(obj, f.name), types[f.name])
            object.__setattr__(obj, f.name, value)


def _choice(key: str, value: str, options: Collection[str]) -> None:
    if value not in options:
        raise ConfigError(f"config key {key!r}: {value!r} is not one of {', '.join(options)}")


COMM_TIMEOUT_MAX = 365 * 86400.0
"""The longest ``comm_timeout``: waits take it as a deadline that must fit the clocks' range."""
SEED_MAX = 2**64 - 1
"""The largest seed: torch's generators and the service's sessions take an unsigned 64-bit one."""


def _seed(key: str, value: int) -> None:
    if not 0 <= value <= SEED_MAX:
        raise ConfigError(f"config key {key!r}: must be between 0 and 2**64 - 1, got {value}")


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"config key {key!r}: must be >= {low}, got {value}")


def _coerce(key: str, value: Any, kind: Any) -> Any:
    """``value`` as ``kind`` (bool, int, float, str or a tuple of ints), or a ``ConfigError``."""
    bad = ConfigError(f"config key {key!r}: expected {_name(kind)}, got {value!r}")
    if kind is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        return _finite(key, value)
    if kind is str:
        if not isinstance(value, str):
            raise bad
        return value
    if not isinstance(value, list | tuple):
        raise bad
    args = typing.get_args(kind)
    if args[-1] is Ellipsis:  # tuple[float, ...]: any number of numbers
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in value):
            raise bad
        return tuple(_finite(key, v) for v in value)
    if len(value) != len(args):  # tuple[int, int, int]
        raise bad
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise bad
    return tuple(value)


def _finite(key: str, value: float) -> float:
    """``value`` as a float, or a ``ConfigError`` for NaN and infinities (``lr = nan``,
    ``comm_timeout = inf``: no key means anything by them)."""
    try:
        out = float(value)
    except OverflowError:  # an integer too large for a float
        out = math.inf
    if not math.isfinite(out):
        raise ConfigError(f"config key {key!r}: expected a finite number, got {value!r}")
    return out


def _name(kind: Any) -> str:
    if typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        if args[-1] is Ellipsis:
            return "a list of numbers"
        return f"a list of {len(args)} positive integers"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]


def parse_override(text: str, types: dict[str, Any] | None = None) -> tuple[str, Any]:
    """``"key=value"`` to ``(key, value)``: a TOML value, or the raw text for a string key.

    ``types``: the keys allowed and their types. Default: :class:`TrainConfig`'s.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r}: expected key=value")
    types = _types() if types is None else types
    if key not in types:
        raise ConfigError(f"unknown config key {key!r} (keys: {', '.join(types)})")
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if types[key] is str:
            return key, raw
        raise ConfigError(f"config key {key!r}: cannot read {raw!r} as a value") from None


def _read(path: str | os.PathLike | None) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict (``{}`` for ``None``)."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {os.fspath(path)}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {os.fspath(path)}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise ConfigError(
            f"config file {os.fspath(path)}: not valid TOML: not UTF-8 text ({exc.reason} at "
            f"byte {exc.start})"
        ) from None


def _train_config(values: dict[str, Any], overrides: typing.Sequence[str]) -> TrainConfig:
    types = _types()
    for key in values:
        if key not in types:
            raise ConfigError(f"unknown config key {key!r} (keys: {', '.join(types)})")
    for text in overrides:
        key, value = parse_override(text)
        values[key] = value
    if "data" not in values:
        raise ConfigError("config key 'data' is missing: name the dataset directory")
    return TrainConfig(**values)


def load_config(
    path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()
) -> TrainConfig:
    """The config in TOML file ``path`` (optional) with ``key=value`` ``overrides`` applied."""
    return _train_config(_read(path), overrides)


def load_tournament(
    path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()
) -> TournamentConfig:
    """The tournament in TOML file ``path`` (its ``[tournament]`` table, the training keys
    beside it) with ``overrides`` applied (``tournament.KEY=VALUE`` for the table's keys)."""
    values = _read(path)
    table = values.pop("tournament", {})
    if not isinstance(table, dict):
        raise ConfigError("config key 'tournament' must be a table ([tournament])")
    types = {f"tournament.{k}": v for k, v in _types(TournamentConfig).items() if k != "train"}
    for key in table:
        if f"tournament.{key}" not in types:
            raise ConfigError(f"unknown config key 'tournament.{key}' (keys: {', '.join(types)})")
    rest = []
    for text in overrides:
        if text.partition("=")[0].strip().startswith("tournament."):
            key, value = parse_override(text, types)
            table[key.removeprefix("tournament.")] = value
        else:
            rest.append(text)
    return TournamentConfig(_train_config(values, rest), **table)

"""Everything about a training run that can be checked before it starts: pure functions.

A spatially split model fails late and on one rank: a block too small for a pooling, or of an
odd length before a stride-2 layer, raises on the rank that holds it while its neighbours wait
in the halo exchange. The driver therefore runs :func:`check_run` on every rank before any
layer communicates and agrees on the outcome (``datastore.ranks.agree``), so a configuration that
cannot work is one clear error on every rank.

Block lengths follow the loader's split (``datastore.maths.partition.split_sizes``: the first
``n % parts`` blocks one voxel longer). Through the model (:func:`level_blocks`):

- a "same" convolution of kernel ``k`` keeps the lengths and needs every block along a split
  axis at least ``k // 2`` long (halos come from the direct neighbour only);
- a 2x max-pool needs every block along a split axis at least 2 long and every block but the
  last even (so the next level's blocks start on the stride), and halves the lengths.

CosmoFlow runs ``conv_blocks`` (convolution, pool) pairs; the U-Net two convolutions and a
pool per level, ``depth`` times, then two convolutions at the bottom (the way up doubles the
lengths back, which matches the skips exactly when every pooled block was even).

A model larger than memory used to fail while it was built, with an out-of-memory traceback:
:func:`model_parameters` counts the parameters of the model ``trainer.train.build_model`` would
build, built on the meta device (exact Python integers: nothing is allocated, and no width
overflows), and
:func:`check_memory` refuses a run whose parameters, gradients and optimizer state
(:func:`optimizer_copies`) cannot fit in the memory it runs in, shared with the other ranks on
the host (or on the GPU). Activations and buffers are left out: only what cannot fit is
refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal

import torch

from datastore.maths.partition import split_sizes
from trainer.dense import FlattenLinear
from trainer.model_table import model_named, parameter_count

__all__ = [
    "check_fields", "check_memory", "check_run", "check_world", "level_blocks", "model_depth",
    "model_parameters", "optimizer_copies", "rank_parameters",
]  # fmt: skip

KERNEL = 3  # both models' convolutions
PARAMETER_BYTES = 4  # float32 parameters, gradients and optimizer state (AMP keeps float32)


def model_depth(model: str, side: int, conv_blocks: int) -> int:
    """Poolings of ``model`` for a cube of ``side``: ``conv_blocks``, or its default when 0."""
    return conv_blocks or model_named(model).default_depth(side)


def level_blocks(
    shape: Sequence[int], parts: Sequence[int], depth: int, kernel: int = KERNEL
) -> list[list[tuple[int, ...]]]:
    """Block lengths per axis at every level, after checking each level's layers.

    Args:
        shape: the sample's spatial shape.
        parts: blocks per axis.
        depth: 2x poolings.
        kernel: the convolutions' kernel.

    Returns:
        ``levels[i][axis]``: the block lengths along ``axis`` at level ``i`` (``depth + 1``
        levels; level 0 is the input).

    Raises:
        ValueError: naming the level, the axis and the block: a side not divisible by
            ``2**depth``, a block shorter than a convolution's halo or the pooling window, or
            an odd block before a pooling (not the last along its axis).
    """
    for axis, n in enumerate(shape):
        if depth >= int(n).bit_length() or n % 2**depth:  # never builds 2**depth for a huge depth
            most = min((int(m) & -int(m)).bit_length() - 1 for m in shape)
            raise ValueError(
                f"side {n} along axis {axis} is not divisible by 2**{depth} ({depth} poolings; "
                f"at most {most} divide every side)"
            )
    levels = [[split_sizes(n, p) for n, p in zip(shape, parts, strict=True)]]
    for level in range(depth + 1):
        lengths = levels[-1]
        for axis, blocks in enumerate(lengths):
            if parts[axis] == 1:
                continue
            if min(blocks) < kernel // 2:
                raise ValueError(
                    f"level {level}: a block of {min(blocks)} voxels along split axis {axis} is "
                    f"smaller than the convolution's halo {kernel // 2}; split that axis less"
                )
            if level == depth:
                continue
            if min(blocks) < 2:
                raise ValueError(
                    f"level {level}: a block of {min(blocks)} voxel along split axis {axis} "
                    "cannot be pooled 2x; use fewer poolings (conv_blocks) or split that axis less"
                )
            odd = [i for i, n in enumerate(blocks[:-1]) if n % 2]
            if odd:
                raise ValueError(
                    f"level {level}: block {odd[0]} along split axis {axis} has {blocks[odd[0]]} "
                    "voxels, an odd number, before a 2x pooling; choose parts that divide the "
                    "side into even blocks at every level"
                )
        if level < depth:
            levels.append([tuple(n // 2 for n in blocks) for blocks in lengths])
    return levels


def check_world(world: int, parts: Sequence[int]) -> int:
    """The data-parallel size ``world / prod(parts)``.

    Raises:
        ValueError: if ``prod(parts)`` does not divide ``world``.
    """
    blocks = math.prod(parts)
    if world % blocks:
        raise ValueError(
            f"{world} rank(s) cannot hold data x spatial replicas of {blocks} blocks "
            f"(spatial_parts {list(parts)}): the number of ranks must be a multiple of {blocks}"
        )
    return world // blocks


def check_fields(
    model: str,
    inputs: tuple[str, Sequence[int], Sequence[int]],
    targets: tuple[str, Sequence[int], Sequence[int]],
) -> None:
    """Check the input and target fields' per-sample shapes and spatial axes for ``model``:
    the input ``(C, D, H, W)`` with spatial axes ``(1, 2, 3)``, then the model's own check
    (``trainer.model_table.Model.check_fields``).

    Args:
        model: a name in ``trainer.model_table.MODELS``.
        inputs, targets: ``(name, shape, spatial axes)`` of each field.

    Raises:
        ValueError: naming the field.
    """
    name, shape, axes = inputs
    if len(shape) != 4 or tuple(axes) != (1, 2, 3):
        raise ValueError(
            f"input field {name!r}: expected (channels, depth, height, width) per sample with "
            f"spatial axes (1, 2, 3), got shape {tuple(shape)}, spatial axes {tuple(axes)}"
        )
    model_named(model).check_fields(inputs, targets)


def check_run(
    model: str,
    inputs: tuple[str, Sequence[int], Sequence[int]],
    targets: tuple[str, Sequence[int], Sequence[int]],
    parts: Sequence[int],
    conv_blocks: int,
    world: int,
) -> int:
    """:func:`check_fields`, :func:`check_world` and :func:`level_blocks`; the model's depth."""
    check_fields(model, inputs, targets)
    check_world(world, parts)
    spatial = tuple(inputs[1][1:])
    depth = model_depth(model, min(spatial), conv_blocks)
    try:
        level_blocks(spatial, parts, depth)
    except ValueError as exc:
        split = math.prod(parts) > 1
        keys = "keys 'spatial_parts', 'conv_blocks'" if split else "key 'conv_blocks'"
        raise ValueError(f"config {keys}: {exc}") from None
    return depth


def model_parameters(
    model: str, in_channels: int, out_channels: int, side: int, width: int, depth: int
) -> int:
    """Trainable parameters of ``model`` as ``trainer.train.build_model`` builds it for a cube
    of ``side``, counted on the meta device (``trainer.model_table.parameter_count``; the
    spatially split layers hold the same parameters on every rank).

    Args:
        model: a name in ``trainer.model_table.MODELS``.
        in_channels, out_channels: the input's channels; the target's (CosmoFlow's outputs).
        side: the cube's side.
        width: the first level's filters (config key ``width``).
        depth: the poolings (:func:`model_depth`; checked by :func:`level_blocks` first).
    """
    return parameter_count(model_named(model), in_channels, out_channels, (side,) * 3, width, depth)


def rank_parameters(
    model: str, in_channels: int, out_channels: int, side: int, width: int, depth: int,
    parts: tuple[int, ...],
) -> int:  # fmt: skip
    """The most parameters one rank of a ``parts`` split holds: :func:`model_parameters` less
    the first dense layer's columns of the other blocks (``trainer.dense``: its weight is split
    by input features; the rank of the largest block holds most). A model torch cannot describe
    even on the meta device counts whole (a pessimistic bound)."""
    whole = model_parameters(model, in_channels, out_channels, side, width, depth)
    if math.prod(parts) == 1:
        return whole
    try:
        with torch.device("meta"):
            built = model_named(model).build(in_channels, out_channels, (side,) * 3, width=width,
                                              depth=depth, dropout=0.0, layers=None)  # fmt: skip
    except (RuntimeError, TypeError, OverflowError):  # (as model_parameters)
        return whole
    split = [m for m in built.modules() if isinstance(m, FlattenLinear)]
    return whole - sum(m.weight.numel() - m.rank_weights(parts) for m in split)


def optimizer_copies(optimizer: str, momentum: float) -> int:
    """Copies of the parameters ``optimizer`` keeps as state: Adam's two moments, SGD's momentum
    buffer (none without momentum), LARS's momentum buffer, Lion's (and Lion Cub's) momentum."""
    if optimizer == "adam":
        return 2
    if optimizer == "sgd":
        return 1 if momentum else 0
    return 1


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{Decimal(n) / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**9 else f"{Decimal(n):.3g}"


def check_memory(
    model: str,
    width: int,
    depth: int,
    params: int,
    optimizer: str,
    copies: int,
    device: str,
    device_memory: int | None,
    host_memory: int | None,
    on_rank: int | None = None,
    buckets: bool = False,
    device_ranks: int = 1,
    host_ranks: int = 1,
) -> None:
    """Refuse a model whose parameters on a rank (``on_rank``, :func:`rank_parameters`; default
    ``params``), their gradients, ``copies`` optimizer state copies and, with ``buckets``, the
    gradient reducer's flat copy of the gradients (a job of several ranks:
    ``trainer.reduce.GradientReducer``), ``PARAMETER_BYTES`` each, times the ``device_ranks``
    ranks that share ``device``, exceed ``device_memory``, its memory (``"cpu"``: the host's
    available memory, shared by the ranks on the host), or whose parameters alone (``params``,
    all of them: the split layers are drawn whole first) times the ``host_ranks`` ranks on the
    host exceed ``host_memory`` (the model is built on the CPU, then moved to a GPU).
    ``None``: unknown, not checked.

    Raises:
        ValueError: naming the config keys, the estimate, the ranks sharing the memory and the
            memory.
    """
    on_rank = params if on_rank is None else on_rank
    need = on_rank * (2 + copies + buckets) * PARAMETER_BYTES
    keys = "config keys 'width', 'conv_blocks', 'model'"
    this = f"a {model} of width {width} with {depth} poolings has {_count(params)} parameters"
    if on_rank != params:
        this += f" ({_count(on_rank)} on the rank of the largest block)"
    state = f"no {optimizer} state"
    if copies:
        state = f"{optimizer}'s {copies} state cop{'y' if copies == 1 else 'ies'}"
    if buckets:
        state += " and the gradient reducer's buckets"
    fix = "choose a smaller width or fewer conv_blocks"
    if device_memory is not None and need * device_ranks > device_memory:
        where = "available on the host" if device == "cpu" else f"free on {device}"
        raise ValueError(
            f"{keys}: {this}; with their gradients and {state} ({PARAMETER_BYTES} bytes each) "
            f"training needs {_shared(need, device_ranks, device)}, more than the "
            f"{_size(device_memory)} {where}; {fix}{_fewer(device_ranks, device)}"
        )
    built = params * PARAMETER_BYTES
    if host_memory is not None and built * host_ranks > host_memory:
        moves = "" if device == "cpu" else f" before it moves to {device}"
        raise ValueError(
            f"{keys}: {this} ({_shared(built, host_ranks, 'cpu')}), built whole on the host"
            f"{moves}: more than the {_size(host_memory)} available on the host; "
            f"{fix}{_fewer(host_ranks, 'cpu')}"
        )


def _shared(need: int, ranks: int, device: str) -> str:
    """``need`` bytes a rank, and what the ``ranks`` sharing ``device`` need together."""
    if ranks == 1:
        return _size(need)
    where = "this host" if device == "cpu" else device
    return f"{_size(need)} a rank, {_size(need * ranks)} for the {ranks} ranks on {where}"


def _fewer(ranks: int, device: str) -> str:
    return (
        "" if ranks == 1 else f", or launch fewer ranks per {'host' if device == 'cpu' else 'GPU'}"
    )

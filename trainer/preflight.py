"""Everything about a training run that can be checked before it starts: pure functions.

A spatially split model fails late and on one rank: a block too small for a pooling, or of an
odd length before a stride-2 layer, raises on the rank that holds it while its neighbours wait
in the halo exchange. The driver therefore runs :func:`check_run` on every rank before any
layer communicates and agrees on the outcome (``datastore.agree``), so a configuration that
cannot work is one clear error on every rank.

Block lengths follow the loader's split (``datastore.partition.split_sizes``: the first
``n % parts`` blocks one voxel longer). Through the model (:func:`level_blocks`):

- a "same" convolution of kernel ``k`` keeps the lengths and needs every block along a split
  axis at least ``k // 2`` long (halos come from the direct neighbour only);
- a 2x max-pool needs every block along a split axis at least 2 long and every block but the
  last even (so the next level's blocks start on the stride), and halves the lengths.

CosmoFlow runs ``conv_blocks`` (convolution, pool) pairs; the U-Net two convolutions and a
pool per level, ``depth`` times, then two convolutions at the bottom (the way up doubles the
lengths back, which matches the skips exactly when every pooled block was even).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from datastore.partition import split_sizes

__all__ = ["check_fields", "check_run", "check_world", "level_blocks", "model_depth"]

KERNEL = 3  # both models' convolutions


def model_depth(model: str, side: int, conv_blocks: int) -> int:
    """Poolings of ``model`` for a cube of ``side``: ``conv_blocks``, or its default when 0."""
    if conv_blocks:
        return conv_blocks
    levels = int(math.log2(side)) if side > 0 else 0
    return min(5, levels) if model == "cosmoflow" else max(1, min(3, levels - 2))


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
        if n % 2**depth:
            raise ValueError(
                f"side {n} along axis {axis} is not divisible by 2**{depth} ({depth} poolings)"
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
    """Check the input and target fields' per-sample shapes and spatial axes for ``model``.

    Args:
        model: ``"cosmoflow"`` or ``"unet3d"``.
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
    tname, tshape, taxes = targets
    if model == "cosmoflow":
        if len(shape) == 4 and len(set(shape[1:])) != 1:
            raise ValueError(f"input field {name!r}: cosmoflow needs a cube, got {shape[1:]}")
        if len(tshape) != 1:
            raise ValueError(
                f"target field {tname!r}: cosmoflow predicts a vector per sample, got shape "
                f"{tuple(tshape)}"
            )
    elif len(tshape) != 4 or tuple(tshape[1:]) != tuple(shape[1:]) or tuple(taxes) != (1, 2, 3):
        raise ValueError(
            f"target field {tname!r}: unet3d predicts a volume of the input's spatial shape "
            f"{tuple(shape[1:])} with channels first, got shape {tuple(tshape)}"
        )


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
    level_blocks(spatial, parts, depth)
    return depth

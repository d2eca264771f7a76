"""Pure block geometry of the spatial layers: strided windows, stride alignment, block offsets.

Ownership of outputs
    Along one axis a rank owns the input voxels ``[a, a + n)``. A layer of stride ``s`` maps
    output ``o`` to the input window that starts at ``o * s - pad`` (``pad = k // 2`` for a
    "same" convolution, ``0`` for pooling); the rank owns the outputs whose *anchor* ``o * s``
    lies in its block. When every block starts on a multiple of ``s`` (every block but the last
    along a split axis has a multiple of ``s`` voxels) these are ``[a / s, a / s + ceil(n / s))``
    (fewer in the last block of an unpadded pool, whose windows must fit in the volume), so the
    output blocks tile the global output with no gap and no overlap, and the output is again
    split block-wise over the same ranks.

Halo of a strided convolution
    ``Conv3d(k, stride=s, padding=k // 2)`` (odd ``k``, ``p = k // 2``) reads, for the outputs of
    a block, the inputs ``[a - p, a + (ceil(n / s) - 1) * s + k - p)``: ``p`` voxels left of the
    block and ``(ceil(n / s) - 1) * s + k - p - n`` right of it (:func:`conv_window`). For
    stride 1 both are ``p``. For ``k = 3, s = 2`` and an even block they are ``(1, 0)``; a
    negative right width means the last voxels of the block are read by no owned output.
    Outside the global volume the window is zero padding, as torch's.

Interior and shell of a stride-1 convolution (overlap of the halo exchange)
    Boxes are ``((start, stop), ...)`` per spatial axis. A stride-1 "same" convolution of a
    block of ``n`` voxels with halo ``h = k // 2`` has ``n`` outputs; output ``o`` reads
    ``[o, o + 2h]`` of the padded block (:func:`conv_input_box`), the owned voxels being
    ``[h, h + n)``. Along a side with a neighbour the first (last) ``h`` outputs read the halo
    slab that neighbour sends; every other output reads owned voxels or the global zero
    padding. The *interior* (:func:`interior_box`) is the box of outputs that read no received
    halo on any axis: it can be computed before the halos arrive. The *shell*
    (:func:`shell_slabs`) is the rest, cut axis by axis into at most two slabs per axis, so
    that wrapping the interior in the slabs of the last axis, then of the one before, and so
    on (``torch.cat`` along that axis) rebuilds the whole output block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainer.grid import spatial_coords_of

__all__ = [
    "Box",
    "block_offsets",
    "box_size",
    "check_aligned",
    "check_conv_block",
    "check_pool_blocks",
    "check_pool_windows",
    "conv_input_box",
    "conv_out_size",
    "conv_window",
    "interior_box",
    "owned_outputs",
    "pool_out_size",
    "shell_slabs",
]

Box = tuple[tuple[int, int], ...]
"""``((start, stop), ...)``: a half-open range per spatial axis."""


def conv_out_size(n: int, kernel: int, stride: int) -> int:
    """Output length of ``Conv3d(kernel, stride, padding=kernel // 2)`` over ``n`` voxels."""
    return (n + 2 * (kernel // 2) - kernel) // stride + 1


def pool_out_size(n: int, kernel: int, stride: int) -> int:
    """Output length of an unpadded pool (``MaxPool3d``/``AvgPool3d``) over ``n`` voxels."""
    return (n - kernel) // stride + 1


def owned_outputs(n: int, stride: int) -> int:
    """Outputs owned by a block of ``n`` voxels starting on the stride: ``ceil(n / stride)``."""
    return -(-n // stride)


def conv_window(n: int, kernel: int, stride: int) -> tuple[int, int]:
    """``(left, right)`` input voxels beyond a block of ``n`` that its owned outputs read.

    For ``Conv3d(kernel, stride, padding=kernel // 2)``, odd ``kernel``, a block that starts on
    a multiple of ``stride``. ``right`` may be negative (trailing voxels nobody reads).
    """
    if kernel < 1 or kernel % 2 == 0 or stride < 1 or n < 1:
        raise ValueError(f"need an odd kernel, stride >= 1, n >= 1; got {kernel}, {stride}, {n}")
    pad = kernel // 2
    return pad, (owned_outputs(n, stride) - 1) * stride + kernel - pad - n


def check_aligned(
    owned: Sequence[int],
    parts: Sequence[int],
    coords: Sequence[int],
    stride: Sequence[int],
    what: str = "layer",
) -> None:
    """Raise unless every split axis lets the next block start on the stride.

    Args:
        owned: spatial shape of this rank's block.
        parts: blocks per axis.
        coords: this block's coordinates in ``parts``.
        stride: stride per axis.
        what: the layer, for the message.

    Raises:
        ValueError: naming the axis, if a block that is not the last along a split axis has a
            number of voxels that is not a multiple of the stride there.
    """
    for axis, (n, p, c, s) in enumerate(zip(owned, parts, coords, stride, strict=True)):
        if p > 1 and c < p - 1 and n % s:
            raise ValueError(
                f"{what}: block {c} of {p} along split axis {axis} has {n} voxels, not a "
                f"multiple of the stride {s}; every block but the last along a split axis must "
                "be, so that every block starts on the stride"
            )


def check_conv_block(
    owned: Sequence[int],
    parts: Sequence[int],
    coords: Sequence[int],
    stride: Sequence[int],
    halo: Sequence[int],
    what: str = "DistConv3d",
) -> None:
    """Raise unless a split "same" convolution can run on this block.

    Needs at least one voxel per axis, the block aligned to the stride (:func:`check_aligned`)
    and, along split axes, at least ``halo`` voxels (halos come from the direct neighbour only).

    Raises:
        ValueError: naming the axis.
    """
    for axis, (n, p, h) in enumerate(zip(owned, parts, halo, strict=True)):
        if n < 1:
            raise ValueError(f"{what}: a block of {n} voxels along axis {axis}; need >= 1")
        if p > 1 and n < h:
            raise ValueError(
                f"{what}: a block of {n} voxels along split axis {axis} cannot fill a halo of "
                f"{h} (halos come from the direct neighbour only)"
            )
    check_aligned(owned, parts, coords, stride, what)


def check_pool_windows(kernel: Sequence[int], stride: Sequence[int], what: str = "pool") -> None:
    """Raise unless pooling windows do not overlap (``stride >= kernel`` on every axis).

    Raises:
        ValueError: naming the axis.
    """
    for axis, (k, s) in enumerate(zip(kernel, stride, strict=True)):
        if s < k:
            raise ValueError(
                f"{what}: stride {s} < kernel {k} along axis {axis}; overlapping windows would "
                "need a halo, which distributed pooling does not exchange"
            )


def check_pool_blocks(
    owned: Sequence[int],
    parts: Sequence[int],
    coords: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    what: str = "pool",
) -> None:
    """Raise unless an unpadded pool with non-overlapping windows can run on this block alone.

    Needs the block aligned to the stride (:func:`check_aligned`) and, along split axes, at
    least ``kernel`` voxels long.

    Raises:
        ValueError: naming the axis.
    """
    check_aligned(owned, parts, coords, stride, what)
    for axis, (n, p, k) in enumerate(zip(owned, parts, kernel, strict=True)):
        if p > 1 and n < k:
            raise ValueError(
                f"{what}: a block of {n} voxels along split axis {axis} is shorter than the "
                f"kernel {k}"
            )


def block_offsets(
    parts: Sequence[int], shapes: Sequence[Sequence[int]]
) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """Where every block lies in the whole volume, from the blocks' shapes.

    Args:
        parts: blocks per axis.
        shapes: spatial shape of block ``r`` (C order over ``parts``) for every ``r``.

    Returns:
        ``(offsets, shape)``: the start of every block, and the whole volume's shape.

    Raises:
        ValueError: if the shapes do not tile a box (blocks in one slab differ in length).
    """
    if len(shapes) != math.prod(parts):
        raise ValueError(f"{len(shapes)} shapes for {math.prod(parts)} blocks of {tuple(parts)}")
    coords = [spatial_coords_of(parts, r) for r in range(len(shapes))]
    lengths: list[list[int | None]] = [[None] * p for p in parts]
    for r, shape in enumerate(shapes):
        for axis, n in enumerate(shape):
            seen = lengths[axis][coords[r][axis]]
            if seen is not None and seen != n:
                raise ValueError(
                    f"blocks at index {coords[r][axis]} along axis {axis} differ in length "
                    f"({seen} and {n})"
                )
            lengths[axis][coords[r][axis]] = n
    starts = [[sum(ls[:c]) for c in range(len(ls))] for ls in lengths]  # type: ignore[arg-type]
    offsets = [tuple(starts[a][c[a]] for a in range(len(parts))) for c in coords]
    return offsets, tuple(sum(ls) for ls in lengths)  # type: ignore[arg-type]


def box_size(box: Box) -> int:
    """Number of voxels of ``box`` (0 if it is empty along any axis)."""
    return math.prod(max(b - a, 0) for a, b in box)


def interior_box(owned: Sequence[int], halo: Sequence[int], sides: Sequence[Sequence[bool]]) -> Box:
    """The stride-1 outputs of a block that read no halo received from a neighbour.

    Args:
        owned: spatial shape of the block (= its outputs for stride 1).
        halo: halo width per axis (``kernel // 2``).
        sides: per axis, ``(low, high)``: whether a neighbour sends a halo on that side.

    Returns:
        Per axis ``(start, stop)`` in output coordinates: ``start = h`` with a low neighbour
        (else 0), ``stop = n - h`` with a high neighbour (else ``n``); when the two meet
        (``n < 2h``) the interior is empty there (``stop == start``).
    """
    if not len(owned) == len(halo) == len(sides):
        raise ValueError(f"length mismatch: owned {owned}, halo {halo}, sides {sides}")
    box = []
    for n, h, (lo, hi) in zip(owned, halo, sides, strict=True):
        if n < 1 or h < 0:
            raise ValueError(f"need blocks of >= 1 voxel and halos >= 0; got {n}, {h}")
        start = min(h if lo else 0, n)
        stop = max(n - h if hi else n, start)
        box.append((start, stop))
    return tuple(box)


def shell_slabs(shape: Sequence[int], interior: Box) -> list[tuple[int, int, Box]]:
    """The outputs of a block outside ``interior``, as disjoint slabs, axis by axis.

    The slabs of axis ``k`` span the interior along the axes before ``k``, the whole block along
    the axes after it, and ``[0, start_k)`` (side 0) or ``[stop_k, n_k)`` (side 1) along ``k``.
    Together with the interior they tile the block exactly once, and for ``k`` from the last
    axis to the first, ``[low slab of k, core, high slab of k]`` concatenated along ``k`` is
    again a box (the core spanning the whole block along ``k`` and after), ending in the block.

    Args:
        shape: spatial shape of the output block.
        interior: from :func:`interior_box` (``0 <= start <= stop <= n`` per axis).

    Returns:
        ``(axis, side, box)`` for every non-empty slab, by axis, low side first.
    """
    if len(shape) != len(interior):
        raise ValueError(f"length mismatch: shape {tuple(shape)}, interior {interior}")
    for n, (a, b) in zip(shape, interior, strict=True):
        if not 0 <= a <= b <= n:
            raise ValueError(f"interior {interior} does not lie in the block {tuple(shape)}")
    out = []
    for axis, (n, (a, b)) in enumerate(zip(shape, interior, strict=True)):
        for side, span in enumerate(((0, a), (b, n))):
            box = (*interior[:axis], span, *((0, m) for m in shape[axis + 1 :]))
            if box_size(box):
                out.append((axis, side, box))
    return out


def conv_input_box(box: Box, halo: Sequence[int]) -> Box:
    """The padded-block voxels that the stride-1 outputs ``box`` read: ``[a, b + 2h)``.

    Padded-block coordinates put the owned voxels at ``[h, h + n)``, so output ``o`` (kernel
    ``2h + 1``) reads ``[o, o + 2h]``.
    """
    if len(box) != len(halo):
        raise ValueError(f"length mismatch: box {box}, halo {tuple(halo)}")
    return tuple((a, b + 2 * h) for (a, b), h in zip(box, halo, strict=True))

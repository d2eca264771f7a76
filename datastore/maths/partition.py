"""Spatial-partition geometry: which block of a volume (plus halo) each rank receives.

Pure functions over a frozen :class:`Grid`; numpy only, no I/O. Readers use
:func:`halo_bounds` / :func:`full_region` to know what to read, :func:`extract_block` is the
reference they are checked against, and :func:`assemble` stitches blocks back together.

Uneven split rule
    An axis of ``n`` voxels split into ``p`` blocks gives blocks of ``n // p`` voxels, the first
    ``n % p`` of them one voxel longer (as ``numpy.array_split``): 10 into 3 gives ``(4, 3, 3)``.
    ``p > n`` is an error, since a block of length 0 breaks convolutions.

Block numbering
    Blocks are numbered in C order over the block grid ``parts``, last axis fastest
    (``numpy.ravel_multi_index``). For ``parts=(2, 3)``::

                 axis 1 ->
        axis 0   0 1 2
           |     3 4 5

Boundary policies (what a block's halo becomes where it sticks out of the volume)
    ``"zero"``: every block with halo has the full shape ``owned + 2 * halo``; the part outside
    the volume is zero padding. ``"clip"``: the halo is clipped at the volume boundary, so edge
    blocks are smaller and nothing is padded.

Halo from the direct neighbour only
    A halo is exchanged with the direct neighbour only, so along each split axis the halo may not
    be wider than the smallest block on that axis (``n // p``); otherwise a block would need voxels
    of its neighbour's neighbour (cf. devito issue #1166). An axis with one block has no
    neighbour, so its halo is pure padding ("zero") or nothing ("clip") and is not limited.

Example: ``Grid(shape=(10,), parts=(3,), halo=(1,))`` (``z``: a zero-padding voxel)::

    voxel           0 1 2 3 4 5 6 7 8 9
    owned           0 0 0 0|1 1 1|2 2 2      block sizes (4, 3, 3)
    block 0 "zero"  z 0 1 2 3 4              read [0:5],  pad (1, 0), shape 6
    block 1         3 4 5 6 7                read [3:8],  pad (0, 0), shape 5
    block 2 "zero"  6 7 8 9 z                read [6:10], pad (0, 1), shape 5
    block 0 "clip"  0 1 2 3 4                read [0:5],  pad (0, 0), shape 5

Shapes: a volume has ``grid.ndim`` spatial axes of sizes ``grid.shape``. A sample may carry
other axes too (e.g. ``(C, D, H, W)``); ``spatial_axes`` names its spatial axes in grid-axis order
(``(1, 2, 3)`` there) and every other axis is taken whole and never padded.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = [
    "BOUNDARIES",
    "Grid",
    "assemble",
    "block_bounds",
    "block_coords",
    "block_index",
    "block_shape",
    "extract_block",
    "full_region",
    "halo_bounds",
    "split_sizes",
]

BOUNDARIES = ("zero", "clip")
"""The allowed values of :attr:`Grid.boundary`."""

Region = tuple[tuple[slice, ...], tuple[tuple[int, int], ...]]
"""``(read slices, (before, after) zero padding per axis)``."""


def split_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Block lengths of an axis of ``n`` voxels split into ``parts`` blocks.

    The first ``n % parts`` blocks get one voxel more than the others (as ``numpy.array_split``).

    Args:
        n: Length of the axis.
        parts: Number of blocks, ``1 <= parts <= n``.

    Returns:
        ``parts`` lengths summing to ``n``, non-increasing, differing by at most 1.

    Raises:
        ValueError: If ``parts < 1`` or ``parts > n`` (a block of length 0 breaks convolutions).
    """
    n, parts = operator.index(n), operator.index(parts)
    if parts < 1:
        raise ValueError(f"cannot split an axis into {parts} parts: parts must be >= 1")
    if parts > n:
        raise ValueError(
            f"cannot split an axis of size {n} into {parts} parts: "
            "a block of length 0 breaks convolutions"
        )
    base, extra = divmod(n, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def _ints(name: str, value: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(operator.index(v) for v in value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}") from None


@dataclass(frozen=True)
class Grid:
    """A volume split into a grid of blocks, each with a halo.

    Attributes:
        shape: Spatial shape of the volume, e.g. ``(128, 128, 128)`` (usually 1 to 3 axes).
        parts: Blocks per spatial axis, same length: ``(2, 1, 1)`` depth slabs, ``(2, 2, 1)``
            2-D, ``(2, 2, 2)`` 3-D decomposition.
        halo: Halo width per axis. Default: ``()``, meaning zeros.
        boundary: ``"zero"`` (halo outside the volume is zero padding, all blocks with halo
            have shape ``owned + 2 * halo``) or ``"clip"`` (halo clipped at the volume
            boundary). Default: ``"zero"``.

    Raises:
        ValueError: On mismatched lengths, an axis of size < 1, ``parts < 1``, ``parts > shape``,
            a negative halo, a halo wider than the smallest neighbouring block on its axis (halo
            from the direct neighbour only), or an unknown ``boundary``.
    """

    shape: tuple[int, ...]
    parts: tuple[int, ...]
    halo: tuple[int, ...] = ()
    boundary: str = "zero"

    def __post_init__(self) -> None:
        shape = _ints("shape", self.shape)
        parts = _ints("parts", self.parts)
        halo = _ints("halo", self.halo) if len(self.halo) else (0,) * len(shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "halo", halo)
        if self.boundary not in BOUNDARIES:
            raise ValueError(f"boundary must be one of {BOUNDARIES}, got {self.boundary!r}")
        if not shape:
            raise ValueError("shape must have at least one spatial axis")
        if len(parts) != len(shape) or len(halo) != len(shape):
            raise ValueError(
                f"length mismatch: shape {shape}, parts {parts} and halo {halo} "
                "must have one entry per spatial axis"
            )
        for axis, (n, p, h) in enumerate(zip(shape, parts, halo, strict=True)):
            if n < 1:
                raise ValueError(f"shape[{axis}]={n}: every axis needs at least one voxel")
            if p < 1:
                raise ValueError(f"parts[{axis}]={p}: every axis needs at least one block")
            if p > n:
                raise ValueError(
                    f"parts[{axis}]={p} > shape[{axis}]={n}: cannot split an axis of size {n} "
                    f"into {p} parts, a block of length 0 breaks convolutions"
                )
            if h < 0:
                raise ValueError(f"halo[{axis}]={h}: a halo width must be >= 0")
            if p > 1 and h > n // p:
                raise ValueError(
                    f"halo[{axis}]={h} is wider than the smallest neighbouring block "
                    f"({n // p} voxels: axis {axis} of size {n} split into {p}); a halo is "
                    "taken from the direct neighbour only"
                )

    @property
    def ndim(self) -> int:
        """Number of spatial axes."""
        return len(self.shape)

    @property
    def nblocks(self) -> int:
        """Number of blocks, ``prod(parts)``."""
        return math.prod(self.parts)

    @cached_property
    def sizes(self) -> tuple[tuple[int, ...], ...]:
        """Block lengths per axis: ``sizes[axis] == split_sizes(shape[axis], parts[axis])``."""
        return tuple(split_sizes(n, p) for n, p in zip(self.shape, self.parts, strict=True))

    @cached_property
    def offsets(self) -> tuple[tuple[int, ...], ...]:
        """Block boundaries per axis, ``parts[axis] + 1`` of them from 0 to ``shape[axis]``."""
        return tuple((0, *np.cumsum(s).tolist()) for s in self.sizes)


def block_coords(grid: Grid, index: int) -> tuple[int, ...]:
    """Grid coordinates of block ``index`` (C order, last axis fastest).

    Args:
        grid: The partition.
        index: Block number, ``0 <= index < grid.nblocks``.

    Returns:
        ``grid.ndim`` coordinates, ``0 <= coords[axis] < grid.parts[axis]``.

    Raises:
        IndexError: If ``index`` is out of range.
    """
    index = operator.index(index)
    if not 0 <= index < grid.nblocks:
        raise IndexError(f"block index {index} out of range for {grid.nblocks} blocks")
    coords = []
    for p in reversed(grid.parts):
        index, c = divmod(index, p)
        coords.append(c)
    return tuple(reversed(coords))


def block_index(grid: Grid, coords: Sequence[int]) -> int:
    """Block number of grid coordinates ``coords`` (C order, last axis fastest).

    Args:
        grid: The partition.
        coords: ``grid.ndim`` coordinates, ``0 <= coords[axis] < grid.parts[axis]``.

    Returns:
        The block number, inverse of :func:`block_coords`.

    Raises:
        ValueError: If ``coords`` has the wrong length.
        IndexError: If a coordinate is out of range.
    """
    coords = _ints("coords", coords)
    if len(coords) != grid.ndim:
        raise ValueError(f"length mismatch: {len(coords)} coords for a {grid.ndim}-axis grid")
    index = 0
    for axis, (c, p) in enumerate(zip(coords, grid.parts, strict=True)):
        if not 0 <= c < p:
            raise IndexError(f"coords[{axis}]={c} out of range for {p} blocks")
        index = index * p + c
    return index


def block_bounds(grid: Grid, index: int) -> tuple[slice, ...]:
    """Owned region (no halo) of block ``index`` in volume coordinates.

    Returns:
        ``grid.ndim`` slices ``slice(start, stop)``; over all blocks they tile the volume.
    """
    coords = block_coords(grid, index)
    return tuple(slice(o[c], o[c + 1]) for o, c in zip(grid.offsets, coords, strict=True))


def halo_bounds(grid: Grid, index: int) -> Region:
    """What to read from the volume for block ``index`` with its halo, and how to pad it.

    Returns:
        ``(read, pad)``: ``read`` is ``grid.ndim`` slices, the owned region grown by the halo
        and clipped to the volume; ``pad`` is ``(before, after)`` zero padding per axis that
        turns ``volume[read]`` into the block with halo (``np.pad(volume[read], pad)``). All
        padding is ``(0, 0)`` under ``"clip"``.
    """
    read, pad = [], []
    for own, h, n in zip(block_bounds(grid, index), grid.halo, grid.shape, strict=True):
        start, stop = max(own.start - h, 0), min(own.stop + h, n)
        read.append(slice(start, stop))
        if grid.boundary == "zero":
            pad.append((h - (own.start - start), h - (stop - own.stop)))
        else:
            pad.append((0, 0))
    return tuple(read), tuple(pad)


def block_shape(grid: Grid, index: int, with_halo: bool = True) -> tuple[int, ...]:
    """Spatial shape of block ``index``.

    Args:
        grid: The partition.
        index: Block number.
        with_halo: Include the halo (padded or clipped per ``grid.boundary``). Default: ``True``.

    Returns:
        ``grid.ndim`` lengths; under ``"zero"`` with halo, ``owned + 2 * halo``.
    """
    if not with_halo:
        return tuple(s.stop - s.start for s in block_bounds(grid, index))
    read, pad = halo_bounds(grid, index)
    return tuple(s.stop - s.start + b + a for s, (b, a) in zip(read, pad, strict=True))


def _spatial_axes(grid: Grid, sample_ndim: int, spatial_axes: Sequence[int] | None) -> list[int]:
    """Validated, non-negative spatial axes of a ``sample_ndim``-axis array."""
    if spatial_axes is None:
        if sample_ndim != grid.ndim:
            raise ValueError(
                f"a {sample_ndim}-axis array needs spatial_axes for a {grid.ndim}-axis grid"
            )
        return list(range(grid.ndim))
    axes = _ints("spatial_axes", spatial_axes)
    if len(axes) != grid.ndim:
        raise ValueError(f"length mismatch: {len(axes)} spatial_axes for a {grid.ndim}-axis grid")
    if any(not -sample_ndim <= a < sample_ndim for a in axes):
        raise ValueError(f"spatial_axes {axes} out of range for a {sample_ndim}-axis array")
    norm = [a % sample_ndim for a in axes]
    if len(set(norm)) != len(norm):
        raise ValueError(f"spatial_axes {axes} repeat an axis")
    return norm


def full_region(grid: Grid, index: int, sample_ndim: int, spatial_axes: Sequence[int]) -> Region:
    """:func:`halo_bounds` for a whole sample array with other, non-spatial axes.

    Args:
        grid: The partition.
        index: Block number.
        sample_ndim: Number of axes of the sample, e.g. 4 for ``(C, D, H, W)``.
        spatial_axes: The sample's spatial axes in grid-axis order, e.g. ``(1, 2, 3)``.

    Returns:
        ``(read, pad)`` with ``sample_ndim`` entries each: spatial axes as in
        :func:`halo_bounds`, every other axis ``slice(0, None)`` and ``(0, 0)``.
    """
    axes = _spatial_axes(grid, sample_ndim, spatial_axes)
    spatial_read, spatial_pad = halo_bounds(grid, index)
    read = [slice(0, None)] * sample_ndim
    pad = [(0, 0)] * sample_ndim
    for k, a in enumerate(axes):
        read[a], pad[a] = spatial_read[k], spatial_pad[k]
    return tuple(read), tuple(pad)


def _check_volume(grid: Grid, shape: tuple[int, ...], axes: list[int]) -> None:
    spatial = tuple(shape[a] for a in axes)
    if spatial != grid.shape:
        raise ValueError(f"array has spatial shape {spatial}, the grid expects {grid.shape}")


def extract_block(
    volume: np.ndarray,
    grid: Grid,
    index: int,
    spatial_axes: Sequence[int] | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Block ``index`` with its halo, cut from ``volume`` by slicing and zero padding.

    The reference that readers are checked against: equal to
    ``np.pad(volume[read], pad)`` with ``(read, pad) = full_region(...)``.

    Args:
        volume: The whole sample; its spatial axes have sizes ``grid.shape``.
        grid: The partition.
        index: Block number.
        spatial_axes: The spatial axes of ``volume`` in grid-axis order. Default: ``None``, all
            axes (then ``volume.ndim`` must equal ``grid.ndim``).
        out: Array to fill, of the block's shape and a dtype ``volume`` casts to (same kind).
            Default: ``None``, a new array of ``volume.dtype``.

    Returns:
        ``out`` or a new array: non-spatial axes whole, spatial axes
        :func:`block_shape` ``(grid, index)``.
    """
    axes = _spatial_axes(grid, volume.ndim, spatial_axes)
    _check_volume(grid, volume.shape, axes)
    read, pad = full_region(grid, index, volume.ndim, axes)
    part = volume[read]
    shape = tuple(n + b + a for n, (b, a) in zip(part.shape, pad, strict=True))
    if out is None:
        out = np.zeros(shape, dtype=volume.dtype)
    elif out.shape != shape:
        raise ValueError(f"out has shape {out.shape}, block {index} has shape {shape}")
    elif any(b or a for b, a in pad):
        out[...] = 0
    inner = tuple(slice(b, b + n) for n, (b, _) in zip(part.shape, pad, strict=True))
    np.copyto(out[inner], part, casting="same_kind")
    return out


def _owned_in_block(grid: Grid, index: int) -> tuple[slice, ...]:
    """The owned region inside block ``index`` with halo, in block coordinates."""
    read, pad = halo_bounds(grid, index)
    return tuple(
        slice(own.start - r.start + b, own.stop - r.start + b)
        for own, r, (b, _) in zip(block_bounds(grid, index), read, pad, strict=True)
    )


def assemble(
    blocks: Sequence[np.ndarray],
    grid: Grid,
    spatial_axes: Sequence[int] | None = None,
    *,
    with_halo: bool = False,
) -> np.ndarray:
    """Stitch blocks back into the whole volume (inverse of :func:`extract_block`).

    Args:
        blocks: ``grid.nblocks`` arrays in block order; non-spatial axes equal across blocks.
        grid: The partition.
        spatial_axes: The spatial axes of the blocks in grid-axis order. Default: ``None``, all
            axes.
        with_halo: ``True`` if the blocks carry their halo (shape ``block_shape(grid, i)``),
            which is stripped; ``False`` if they are owned regions only
            (``block_shape(grid, i, with_halo=False)``). Default: ``False``.

    Returns:
        A new array: non-spatial axes as the blocks', spatial axes ``grid.shape``.

    Raises:
        ValueError: On the wrong number of blocks or a block of the wrong shape.
    """
    if len(blocks) != grid.nblocks:
        raise ValueError(f"got {len(blocks)} blocks, the grid has {grid.nblocks}")
    ndim = blocks[0].ndim
    axes = _spatial_axes(grid, ndim, spatial_axes)
    shape = list(blocks[0].shape)
    for k, a in enumerate(axes):
        shape[a] = grid.shape[k]
    volume = np.empty(shape, dtype=np.result_type(*blocks))
    for i, block in enumerate(blocks):
        expected = list(shape)
        for k, n in enumerate(block_shape(grid, i, with_halo=with_halo)):
            expected[axes[k]] = n
        if block.shape != tuple(expected):
            raise ValueError(
                f"block {i} has shape {block.shape}, expected {tuple(expected)} "
                f"({'with' if with_halo else 'without'} halo)"
            )
        src = [slice(None)] * ndim
        dst = [slice(None)] * ndim
        inner = _owned_in_block(grid, i) if with_halo else (slice(None),) * grid.ndim
        for k, (own, s) in enumerate(zip(block_bounds(grid, i), inner, strict=True)):
            dst[axes[k]], src[axes[k]] = own, s
        volume[tuple(dst)] = block[tuple(src)]
    return volume

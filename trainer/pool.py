"""Spatially parallel pooling, and the global reductions that feed a dense head.

``DistMaxPool3d`` / ``DistAvgPool3d``
    Unpadded pools with ``stride >= kernel`` (the CosmoFlow case: kernel 2, stride 2) need no
    halo: when every block starts on the stride, each owned output window lies inside the
    rank's block (``trainer.geometry``), so the local pool *is* this rank's block of the global
    pool, forward and backward. The blocks are checked before pooling (every block but the last
    along a split axis a multiple of the stride, each at least the kernel long), the first time
    a shape is seen by all ranks of the spatial group together (``trainer.agree``): a bad block
    on one rank is the same ``ValueError``, naming the rank and the axis, on every rank.

``global_avg_pool`` and ``gather_flatten``
    Turn a split ``(N, C, *owned)`` activation into features of the whole sample, the same on
    every rank of the spatial group: the per-channel mean over the whole volume, or
    ``torch.flatten(whole, 1)`` of the whole volume assembled in C order (what CosmoFlow's
    MLPerf reference does after its last pool). Both are collectives over the spatial group.
    The dense head after them is replicated: each rank of a sample computes the same head on
    the same features, so the gradient arriving at their output is the same on every rank of
    the group, and their backward needs no communication: ``global_avg_pool`` spreads it over
    the owned voxels (divided by the global voxel count), ``gather_flatten`` returns this rank's
    block of it. (The head's own weight gradients are then already whole-sample gradients:
    average them over the data group only, do not sum them over the spatial group.)

Host syncs: none per step. ``global_avg_pool`` keeps the voxel count it all-reduces on the
device; ``gather_flatten`` all-gathers the blocks' shapes (and reads them on the host) only the
first time this rank's block has a new shape, then remembers them for the grid, the rule of
``trainer.agree``: every rank of the group must see a new shape at the same call.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.agree import AgreedShapes
from trainer.comm import all_gather, all_reduce_sum
from trainer.geometry import block_offsets, check_pool_blocks, check_pool_windows
from trainer.grid import ProcessGrid

__all__ = ["DistAvgPool3d", "DistMaxPool3d", "block_shapes", "gather_flatten", "global_avg_pool"]


def _triple(v: int | Sequence[int], name: str) -> tuple[int, int, int]:
    t = (int(v),) * 3 if isinstance(v, int) else tuple(int(x) for x in v)
    if len(t) != 3 or any(x < 1 for x in t):
        raise ValueError(f"{name} must be one size >= 1 or three, got {v!r}")
    return t  # type: ignore[return-value]


def _check_block(owned, coords, *, parts, kernel, stride, what) -> None:
    check_pool_blocks(owned, parts, coords, kernel, stride, what)


class _DistPool3d(nn.Module):
    """``pool(x, kernel_size, stride)`` on this rank's block, once the blocks are checked."""

    _name = ""
    _pool: Any = None  # F.max_pool3d or F.avg_pool3d, as a staticmethod

    def __init__(
        self,
        kernel_size: int | Sequence[int],
        grid: ProcessGrid,
        *,
        stride: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if grid.ndim != 3:
            raise ValueError(f"{self._name} needs a grid with 3 spatial axes, got {grid.parts}")
        self.grid = grid
        self.kernel_size = _triple(kernel_size, "kernel_size")
        self.stride = self.kernel_size if stride is None else _triple(stride, "stride")
        check_pool_windows(self.kernel_size, self.stride, self._name)
        self.agreed = AgreedShapes(self._name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of the pooled volume (``ValueError`` on every rank if any block is
        refused; the first call with a new shape agrees on it over the spatial group)."""
        self._check(x)
        return self._pool(x, self.kernel_size, self.stride)

    def _check(self, x: torch.Tensor) -> None:
        """Agree on a new input shape over the spatial group (``trainer.agree``): a block one
        rank refuses raises the same ``ValueError`` on every rank, before the next layer's
        communication could wait for it."""
        g = self.grid
        ks, ss = self.kernel_size, self.stride
        check = functools.partial(
            _check_block, parts=g.parts, kernel=ks, stride=ss, what=self._name
        )
        self.agreed.check(x, g, check)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, parts={self.grid.parts}"


class DistMaxPool3d(_DistPool3d):
    """``MaxPool3d(kernel_size, stride)`` (no padding) over a spatially split ``(N, C, D, H, W)``.

    Args:
        kernel_size: one size or three.
        grid: this rank's process grid (3 spatial axes).
        stride: one or three, each at least the kernel. Default: ``None``, the kernel size.
    """

    _name = "DistMaxPool3d"
    _pool = staticmethod(F.max_pool3d)


class DistAvgPool3d(_DistPool3d):
    """``AvgPool3d(kernel_size, stride)`` (no padding) over a spatially split ``(N, C, D, H, W)``,
    with the arguments of :class:`DistMaxPool3d`."""

    _name = "DistAvgPool3d"
    _pool = staticmethod(F.avg_pool3d)


class GlobalAvgPool(torch.autograd.Function):
    """Forward: sum over owned voxels, all-reduce over the spatial group, divide by the count.
    Backward: the (replicated) gradient divided by the count, on every owned voxel."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
        spatial = tuple(range(x.dim() - grid.ndim, x.dim()))
        sums = x.sum(spatial, dtype=torch.float64)  # float64: exact counts, no half overflow
        voxels = math.prod(x.shape[d] for d in spatial)
        count = torch.full((1,), voxels, dtype=torch.float64, device=x.device)
        buf = all_reduce_sum(torch.cat([sums.flatten(), count]), grid.spatial_group, grid.timeout)
        ctx.shape, ctx.total = x.shape, buf[-1]  # a tensor: no host sync
        return (buf[:-1] / ctx.total).view(sums.shape).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        view = (*grad.shape, *[1] * (len(ctx.shape) - grad.dim()))
        return (grad / ctx.total).reshape(view).expand(ctx.shape).contiguous(), None


def global_avg_pool(x: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """Mean of the whole volume over its spatial axes: ``(N, C, *owned)`` to ``(N, C)``.

    Collective over ``grid.spatial_group``; the same result on every rank of it. Backward
    assumes the same incoming gradient on every rank of the group (a replicated head).
    """
    return GlobalAvgPool.apply(x, grid)


_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""grid -> {this rank's input shape: every spatial rank's block shape}, for :func:`block_shapes`."""


def block_shapes(x: torch.Tensor, grid: ProcessGrid) -> list[tuple[int, ...]]:
    """The spatial shape of every spatial rank's block, by spatial rank.

    All-gathered over ``grid.spatial_group`` (and read on the host) the first time this rank's
    ``x`` has a new shape, remembered for ``grid`` afterwards (the module docstring).
    """
    known = _shapes.setdefault(grid, {})
    shape = tuple(x.shape)
    if shape not in known:
        nd = grid.ndim
        mine = torch.tensor(shape[-nd:], dtype=torch.int64, device=x.device)  # NCCL: on device
        rows = all_gather(mine, grid.spatial_group, grid.timeout)
        known[shape] = [tuple(r.tolist()) for r in rows]
    return known[shape]


class GatherFlatten(torch.autograd.Function):
    """Forward: all-gather the blocks, assemble the whole volume, flatten.
    Backward: this rank's block of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
        nd = grid.ndim
        lead = tuple(x.shape[:-nd])
        # Blocks may differ in shape (uneven splits): pad to the largest, gather.
        shapes = block_shapes(x, grid)
        offsets, whole_shape = block_offsets(grid.parts, shapes)
        biggest = [max(s[a] for s in shapes) for a in range(nd)]
        pad = [w for a in reversed(range(nd)) for w in (0, biggest[a] - x.shape[x.dim() - nd + a])]
        blocks = all_gather(F.pad(x, pad), grid.spatial_group, grid.timeout)
        whole = x.new_empty((*lead, *whole_shape))
        for block, start, size in zip(blocks, offsets, shapes, strict=True):
            where = tuple(slice(o, o + n) for o, n in zip(start, size, strict=True))
            whole[(..., *where)] = block[(..., *(slice(0, n) for n in size))]
        ctx.whole_shape = (*lead, *whole_shape)
        ctx.mine = tuple(
            slice(o, o + n)
            for o, n in zip(offsets[grid.spatial_rank], shapes[grid.spatial_rank], strict=True)
        )
        return whole.flatten(1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad.reshape(ctx.whole_shape)[(..., *ctx.mine)].contiguous(), None


def gather_flatten(x: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """``torch.flatten(whole, 1)`` of the whole volume, on every rank of the spatial group.

    Args:
        x: ``(N, C, *owned)``, this rank's block (blocks in C order over ``grid.parts``).
        grid: this rank's process grid.

    Returns:
        ``(N, C * prod(whole spatial shape))``, exactly the single-process flatten. Backward
        returns this rank's block of the gradient, assuming the same incoming gradient on every
        rank of the spatial group (a replicated head).
    """
    if x.dim() < grid.ndim + 2:
        raise ValueError(f"gather_flatten needs (N, C, *spatial), got shape {tuple(x.shape)}")
    return GatherFlatten.apply(x, grid)

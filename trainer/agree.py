"""Agree on a layer's input geometry over the spatial group before any halo moves.

A spatially split layer refuses some block shapes (a block that does not start the next one on
the stride, one shorter than its halo or pooling window, blocks that do not tile a box). The
check is a pure function of a block's shape and coordinates; run on one rank only, a refusal
would leave the other ranks of the sample waiting out the halo timeout. So the first time a
layer sees an input shape, the ranks of its spatial group all-gather their shapes (one small
collective) and each runs the check for *every* block: all raise the same ``ValueError`` at
once, naming the refused spatial ranks and the shapes of all blocks. The shape is then
remembered (:class:`AgreedShapes`) and later calls with it communicate nothing.

The collective runs when a rank sees a new shape of its *own* block, so every rank of the group
must see a new shape at the same call: true when the whole volume keeps its shape, or when a
new volume changes every block (the batch size, channels, every axis' split). A new volume that
leaves some blocks as they were (an uneven split whose last block alone grows) needs
:meth:`AgreedShapes.clear` on every rank first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trainer.comm import all_gather
from trainer.geometry import block_offsets
from trainer.grid import ProcessGrid, spatial_coords_of

__all__ = ["MAX_DIMS", "AgreedShapes", "group_refusals", "refusal_message"]

MAX_DIMS = 5
"""Most axes of an input the layers take: ``(N, C, D, H, W)``, or ``(C, D, H, W)`` unbatched."""

Check = Callable[[tuple[int, ...], tuple[int, ...]], None]
"""``check(owned, coords)``: raises ``ValueError`` if a block of spatial shape ``owned`` at block
coordinates ``coords`` is refused."""


def group_refusals(
    shapes: Sequence[Sequence[int]], parts: Sequence[int], check: Check
) -> list[tuple[int | None, str]]:
    """Why the spatial group cannot run on these inputs; empty if it can.

    Args:
        shapes: the whole input shape (leading axes, then one per axis of ``parts``) of every
            spatial rank, by spatial rank.
        parts: blocks per axis.
        check: the layer's per-block check.

    Returns:
        ``(spatial rank, reason)`` for every refused block, in rank order, then
        ``(None, reason)`` if the blocks do not tile a box.
    """
    nd = len(parts)
    lead = tuple(shapes[0][:-nd])
    out: list[tuple[int | None, str]] = []
    for r, shape in enumerate(shapes):
        shape = tuple(shape)
        if not nd + 1 <= len(shape) <= MAX_DIMS:
            out.append(
                (r, f"an input of {len(shape)} axes; need (N, C, *spatial) or (C, *spatial)")
            )
            continue
        if shape[:-nd] != lead:
            out.append((r, f"leading axes {shape[:-nd]} differ from spatial rank 0's {lead}"))
            continue
        try:
            check(shape[-nd:], spatial_coords_of(parts, r))
        except ValueError as exc:
            out.append((r, str(exc)))
    if not out:
        try:
            block_offsets(parts, [tuple(s[-nd:]) for s in shapes])
        except ValueError as exc:
            out.append((None, f"the blocks do not tile a volume: {exc}"))
    return out


def refusal_message(
    what: str,
    shapes: Sequence[Sequence[int]],
    refusals: Sequence[tuple[int | None, str]],
    global_ranks: Sequence[int],
) -> str:
    """The one message every rank raises: the refused ranks, their reasons, every block."""
    blocks = ", ".join(f"{r}: {tuple(s)}" for r, s in enumerate(shapes))
    why = "; ".join(
        reason if r is None else f"spatial rank {r} (global rank {global_ranks[r]}): {reason}"
        for r, reason in refusals
    )
    head = f"{what}: the spatial group refuses this input geometry"
    return f"{head}; {why} (inputs by spatial rank: {blocks})"


def _encode(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[axes, *shape]`` padded to a fixed length (too many axes: the count, sizes ``-1``)."""
    sizes = shape if len(shape) <= MAX_DIMS else ()
    row = [len(shape), *sizes, *[-1] * (MAX_DIMS - len(sizes))]
    return torch.tensor(row, dtype=torch.int64, device=device)


def _decode(row: list[int]) -> tuple[int, ...]:
    n = row[0]
    return tuple(row[1 : 1 + n]) if n <= MAX_DIMS else (-1,) * n


class AgreedShapes:
    """The input shapes a layer's spatial group has agreed on (see the module docstring).

    Args:
        what: the layer, for messages.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.shapes: set[tuple[int, ...]] = set()

    def check(self, x: torch.Tensor, grid: ProcessGrid, check: Check) -> None:
        """Return at once for a known shape of ``x``; else agree on it over the spatial group.

        Collective over ``grid.spatial_group`` the first time a shape is seen (alone, with one
        spatial rank, it only checks).

        Raises:
            ValueError: on every rank of the group alike, if any block is refused.
        """
        shape = tuple(x.shape)
        if shape in self.shapes:
            return
        if grid.spatial_size == 1:
            shapes = [shape]
            ranks = [grid.rank]
        else:
            rows = all_gather(_encode(shape, x.device), grid.spatial_group, grid.timeout)
            shapes = [_decode(r.tolist()) for r in rows]
            ranks = [grid.spatial_peer(r) for r in range(grid.spatial_size)]
        refusals = group_refusals(shapes, grid.parts, check)
        if refusals:
            raise ValueError(refusal_message(self.what, shapes, refusals, ranks))
        self.shapes.add(shape)

    def clear(self) -> None:
        """Forget every shape (call on every rank of the group): the next call agrees again."""
        self.shapes.clear()

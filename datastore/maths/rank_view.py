"""What one rank receives: grid -> layout -> global batch -> schedule -> delivered fields.

The embedded loader, the service's client and the service's session all derive a rank's view
here, from the loader's arguments and the dataset's facts (its fields and size), so the three
cannot disagree on the tail policy, the global batch or the blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from datastore.maths.delivery import Delivered, delivered_fields, parse_spatial, spatial_grid
from datastore.maths.order import RankLayout, Schedule, parse_shuffle, rank_layout
from datastore.maths.ownership import Homes, RunOwners
from datastore.maths.partition import Grid

__all__ = ["RankView", "global_batch", "rank_view"]


@dataclass(frozen=True)
class RankView:
    """One rank's view of a job on a dataset.

    Attributes:
        grid: the spatial grid (``None``: whole samples).
        layout: the rank's place in the data x spatial grid.
        schedule: the job's sample sequence (every rank's alike).
        fields: the fields this rank receives (its block's).
        local_batch: the samples this rank receives per step.
        info: the delivered fields as found in the data (``{name: FieldInfo}``).
    """

    grid: Grid | None
    layout: RankLayout
    schedule: Schedule
    fields: tuple[Delivered, ...]
    local_batch: int
    info: Mapping[str, Any] = dataclasses.field(repr=False)

    def fields_of(self, block: int) -> list[Delivered]:
        """The fields spatial block ``block`` receives (computed on demand: a job may have
        many blocks)."""
        return delivered_fields(dict(self.info), self.grid, block)

    def of_rank(self, rank: int) -> RankView:
        """The same job's view from ``rank`` (``ValueError`` outside the world)."""
        lay = rank_layout(rank, self.layout.world, self.layout.spatial_size)
        return dataclasses.replace(self, layout=lay, fields=tuple(self.fields_of(lay.spatial_rank)))


def global_batch(
    batch_size: int | None, global_batch_size: int | None, world: int, spatial: Any = None
) -> int:
    """The samples per step over all data ranks: ``global_batch_size``, or ``batch_size``
    per data rank (``world`` over the blocks of ``spatial``)."""
    parts = parse_spatial(spatial)
    blocks = math.prod(parts["parts"]) if parts else 1
    if world % blocks:
        raise ValueError(f"world size {world} is not a multiple of {blocks} spatial blocks")
    if (batch_size is None) == (global_batch_size is None):
        raise ValueError("give exactly one of batch_size (per rank) and global_batch_size")
    if global_batch_size is not None:
        return int(global_batch_size)
    return int(batch_size) * (world // blocks)


def rank_view(
    info: Mapping[str, Any],
    num_samples: int,
    *,
    rank: int,
    world: int,
    batch_size: int | None = None,
    global_batch_size: int | None = None,
    seed: int = 0,
    shuffle: Any = "global",
    drop_last: bool = True,
    spatial: Any = None,
    owner: RunOwners | None = None,
) -> RankView:
    """The view of ``rank`` of ``world`` on a dataset of ``num_samples`` samples whose
    delivered fields are ``info`` (``{name: FieldInfo}``); ``ValueError`` names what is wrong.

    ``owner`` (who holds each sample) fixes the homes of ``"shard"`` and ``"window:K"``
    shuffles; without it each data rank's home is its balanced contiguous range.
    """
    grid = spatial_grid(dict(info), spatial)
    blocks = grid.nblocks if grid is not None else 1
    layout = rank_layout(rank, world, blocks)
    gb = global_batch(batch_size, global_batch_size, world, spatial)
    shuffle = parse_shuffle(shuffle)
    homes = None
    if shuffle == "shard" or shuffle.startswith("window"):
        homes = (
            Homes(owner, layout.data_world, blocks)
            if owner is not None
            else Homes.contiguous(num_samples, layout.data_world)
        )
    schedule = Schedule(num_samples, gb, seed, shuffle, "drop" if drop_last else "pad", homes)
    local = schedule.local_batch(layout.data_world)
    fields = tuple(delivered_fields(dict(info), grid, layout.spatial_rank))
    return RankView(grid, layout, schedule, fields, local, info)

"""Pure geometry of the trainer: rank layout, groups, neighbours, halo slabs (one process)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from datastore.maths.order import rank_layout
from datastore.maths.partition import Grid, block_coords
from trainer.grid import group_members, neighbours_of, spatial_coords_of
from trainer.halo import exchange_slices, padded_shape
from trainer.layers import _triple

PARTS = [
    (1, 1, 1),
    (2, 1, 1),
    (1, 2, 1),
    (1, 1, 2),
    (2, 2, 1),
    (1, 2, 2),
    (2, 2, 2),
    (3, 1, 2),
    (4,),
    (2, 3),
]


@pytest.mark.parametrize("parts", PARTS)
def test_coords_are_the_partition_numbering(parts):
    grid = Grid(tuple(4 * p for p in parts), parts)
    for s in range(math.prod(parts)):
        assert spatial_coords_of(parts, s) == block_coords(grid, s)
        assert spatial_coords_of(parts, s) == np.unravel_index(s, parts)


@pytest.mark.parametrize("parts", PARTS)
def test_neighbours_are_one_step_along_one_axis(parts):
    for s in range(math.prod(parts)):
        c = spatial_coords_of(parts, s)
        for axis, (lo, hi) in enumerate(neighbours_of(parts, s)):
            for peer, step in ((lo, -1), (hi, 1)):
                if not 0 <= c[axis] + step < parts[axis]:
                    assert peer is None
                    continue
                want = list(c)
                want[axis] += step
                assert spatial_coords_of(parts, peer) == tuple(want)
                # symmetric: I am my neighbour's neighbour on the other side
                assert neighbours_of(parts, peer)[axis][1 if step < 0 else 0] == s


@pytest.mark.parametrize(("world", "spatial"), [(1, 1), (2, 2), (4, 2), (8, 4), (6, 3), (4, 1)])
def test_groups_partition_the_world_spatial_fastest(world, spatial):
    sgroups, dgroups = group_members(world, spatial)
    for groups in (sgroups, dgroups):
        assert sorted(itertools.chain(*groups)) == list(range(world))
        assert all(g == sorted(g) for g in groups)  # group rank == position in the list
    for rank in range(world):
        lay = rank_layout(rank, world, spatial)
        assert sgroups[lay.data_rank].index(rank) == lay.spatial_rank
        assert dgroups[lay.spatial_rank].index(rank) == lay.data_rank


def test_groups_reject_a_world_the_spatial_size_does_not_divide():
    with pytest.raises(ValueError, match="not a multiple"):
        group_members(6, 4)


@pytest.mark.parametrize("owned", [(5, 4, 3), (2, 2, 2), (7,)])
@pytest.mark.parametrize("h", [0, 1, 2])
def test_exchange_slabs(owned, h):
    halo = tuple(min(h, n) for n in owned)
    shape = padded_shape(owned, halo)
    for axis in range(len(owned)):
        s = exchange_slices(owned, halo, axis)
        idx = np.arange(shape[axis])
        n, w = owned[axis], halo[axis]
        pick = {k: idx[v[axis]] for k, v in s.items()}
        assert list(pick["halo_lo"]) == list(range(w))
        assert list(pick["halo_hi"]) == list(range(w + n, n + 2 * w))
        # edges are owned voxels next to each side, as wide as the neighbour's halo
        assert list(pick["edge_lo"]) == list(range(w, 2 * w))
        assert list(pick["edge_hi"]) == list(range(n, n + w))
        owned_idx = set(range(w, w + n))
        assert set(pick["edge_lo"]) <= owned_idx and set(pick["edge_hi"]) <= owned_idx
        for k, v in s.items():  # every other axis spans its full padded extent (corners)
            assert all(v[a] == slice(None) for a in range(len(owned)) if a != axis), k


def test_halo_wider_than_the_block_is_refused():
    with pytest.raises(ValueError, match="cannot fill a halo"):
        exchange_slices((1, 4, 4), (2, 1, 1), 0)


@pytest.mark.parametrize("bad", [2, 0, (3, 3), (3, 4, 3)])
def test_kernel_sizes_must_be_odd(bad):
    with pytest.raises(ValueError, match="odd"):
        _triple(bad)

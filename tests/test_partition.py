"""Spatial-partition geometry: tiling, halos under both boundary policies, numbering, validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.maths.partition import (
    Grid,
    assemble,
    block_bounds,
    block_coords,
    block_index,
    block_shape,
    extract_block,
    full_region,
    halo_bounds,
    split_sizes,
)


@st.composite
def grids(draw, boundary=None):
    """A valid Grid: 1-3 axes of 1..40 voxels, 1..min(size, 4) blocks, halo up to the limit."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 40)) for _ in range(ndim))
    parts = tuple(draw(st.integers(1, min(n, 4))) for n in shape)
    # halo limit: the smallest block when there are neighbours; no neighbour, no limit
    halo = tuple(
        draw(st.integers(0, n // p if p > 1 else n + 2)) for n, p in zip(shape, parts, strict=True)
    )
    if boundary is None:
        boundary = draw(st.sampled_from(["zero", "clip"]))
    return Grid(shape=shape, parts=parts, halo=halo, boundary=boundary)


def _volume(shape):
    # distinct nonzero values, so a misplaced or missing voxel (or a zero pad) shows
    return np.arange(1, 1 + int(np.prod(shape)), dtype=np.int64).reshape(shape)


def _some_blocks(grid, data):
    """All blocks of small grids, a sample of the others (keeps the suite fast)."""
    if grid.nblocks <= 8:
        return range(grid.nblocks)
    return data.draw(
        st.lists(st.integers(0, grid.nblocks - 1), min_size=1, max_size=8, unique=True)
    )


@settings(deadline=None, max_examples=100)
@given(st.integers(1, 200), st.integers(1, 200))
def test_split_sizes_matches_array_split(n, parts):
    if parts > n:
        with pytest.raises(ValueError, match="block of length 0"):
            split_sizes(n, parts)
        return
    sizes = split_sizes(n, parts)
    assert sizes == tuple(len(a) for a in np.array_split(np.arange(n), parts))
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


@settings(deadline=None, max_examples=150)
@given(grids())
def test_owned_blocks_tile_the_volume(grid):
    counter = np.zeros(grid.shape, dtype=np.int64)
    for i in range(grid.nblocks):
        bounds = block_bounds(grid, i)
        assert all(isinstance(s.start, int) and isinstance(s.stop, int) for s in bounds)
        counter[bounds] += 1
        coords = block_coords(grid, i)
        assert block_index(grid, coords) == i
        assert tuple(s.stop - s.start for s in bounds) == tuple(
            grid.sizes[a][c] for a, c in enumerate(coords)
        )
        assert block_shape(grid, i, with_halo=False) == counter[bounds].shape
    assert (counter == 1).all()  # disjoint and covering
    assert [block_coords(grid, i) for i in range(grid.nblocks)] == [
        tuple(int(c) for c in np.unravel_index(i, grid.parts)) for i in range(grid.nblocks)
    ]  # C order


@settings(deadline=None, max_examples=150)
@given(grids(), st.data())
def test_extract_block_matches_padded_or_clipped_volume(grid, data):
    volume = _volume(grid.shape)
    padded = np.pad(volume, [(h, h) for h in grid.halo])
    for i in _some_blocks(grid, data):
        block = extract_block(volume, grid, i)
        own = block_bounds(grid, i)
        if grid.boundary == "zero":
            # the zero-padded volume, shifted by the halo, window grown by 2 * halo
            window = tuple(
                slice(s.start, s.stop + 2 * h) for s, h in zip(own, grid.halo, strict=True)
            )
            expected = padded[window]
            assert block.shape == tuple(
                s.stop - s.start + 2 * h for s, h in zip(own, grid.halo, strict=True)
            )
        else:
            window = tuple(
                slice(max(s.start - h, 0), min(s.stop + h, n))
                for s, h, n in zip(own, grid.halo, grid.shape, strict=True)
            )
            expected = volume[window]
        np.testing.assert_array_equal(block, expected)
        assert block.shape == block_shape(grid, i)
        assert block.dtype == volume.dtype

        read, pad = halo_bounds(grid, i)
        np.testing.assert_array_equal(np.pad(volume[read], pad), block)
        if grid.boundary == "clip":
            assert all(p == (0, 0) for p in pad)

        out = np.full(block.shape, -7, dtype=np.float64)  # garbage must be overwritten
        assert extract_block(volume, grid, i, out=out) is out
        np.testing.assert_array_equal(out, block)


@settings(deadline=None, max_examples=100)
@given(grids())
def test_assemble_inverts_extract(grid):
    volume = _volume(grid.shape)
    owned = [volume[block_bounds(grid, i)] for i in range(grid.nblocks)]
    np.testing.assert_array_equal(assemble(owned, grid), volume)
    np.testing.assert_array_equal(assemble(owned, grid, with_halo=False), volume)
    haloed = [extract_block(volume, grid, i) for i in range(grid.nblocks)]
    np.testing.assert_array_equal(assemble(haloed, grid, with_halo=True), volume)
    if any(block_shape(grid, i) != block_shape(grid, i, False) for i in range(grid.nblocks)):
        with pytest.raises(ValueError, match="without halo"):
            assemble(haloed, grid)


@settings(deadline=None, max_examples=100)
@given(grids(), st.data())
def test_full_region_on_channels_first_sample(grid, data):
    channels = 2
    spatial_axes = tuple(range(1, grid.ndim + 1))  # (C, D, H, W) for a 3-axis grid
    volume = _volume(grid.shape)
    sample = np.stack([volume * (c + 1) for c in range(channels)])
    for i in _some_blocks(grid, data):
        read, pad = full_region(grid, i, sample.ndim, spatial_axes)
        assert read[0] == slice(0, None) and pad[0] == (0, 0)
        sp_read, sp_pad = halo_bounds(grid, i)
        assert read[1:] == sp_read and pad[1:] == sp_pad
        block = np.pad(sample[read], pad)
        ref = extract_block(volume, grid, i)
        np.testing.assert_array_equal(block, np.stack([ref * (c + 1) for c in range(channels)]))
        np.testing.assert_array_equal(extract_block(sample, grid, i, spatial_axes), block)
    blocks = [extract_block(sample, grid, i, spatial_axes) for i in range(grid.nblocks)]
    np.testing.assert_array_equal(assemble(blocks, grid, spatial_axes, with_halo=True), sample)


@settings(deadline=None, max_examples=50)
@given(grids(), st.data())
def test_full_region_on_channels_last_sample(grid, data):
    spatial_axes = tuple(range(grid.ndim))  # (D, H, W, C)
    volume = _volume(grid.shape)
    sample = np.stack([volume, -volume], axis=-1)
    for i in _some_blocks(grid, data):
        read, pad = full_region(grid, i, sample.ndim, spatial_axes)
        assert read[-1] == slice(0, None) and pad[-1] == (0, 0)
        block = extract_block(sample, grid, i, spatial_axes=spatial_axes)
        np.testing.assert_array_equal(block, np.pad(sample[read], pad))
        np.testing.assert_array_equal(block[..., 0], extract_block(volume, grid, i))


def test_split_sizes_examples():
    assert split_sizes(10, 3) == (4, 3, 3)
    assert split_sizes(10, 4) == (3, 3, 2, 2)
    assert split_sizes(7, 7) == (1,) * 7
    assert split_sizes(5, 1) == (5,)


def test_one_axis_example_zero():
    grid = Grid(shape=(10,), parts=(3,), halo=(1,))
    assert grid.ndim == 1 and grid.nblocks == 3 and grid.boundary == "zero"
    assert [block_bounds(grid, i) for i in range(3)] == [
        (slice(0, 4),),
        (slice(4, 7),),
        (slice(7, 10),),
    ]
    assert halo_bounds(grid, 0) == ((slice(0, 5),), ((1, 0),))
    assert halo_bounds(grid, 1) == ((slice(3, 8),), ((0, 0),))
    assert halo_bounds(grid, 2) == ((slice(6, 10),), ((0, 1),))
    assert [block_shape(grid, i) for i in range(3)] == [(6,), (5,), (5,)]
    volume = np.arange(10) + 10
    np.testing.assert_array_equal(extract_block(volume, grid, 0), [0, 10, 11, 12, 13, 14])
    np.testing.assert_array_equal(extract_block(volume, grid, 2), [16, 17, 18, 19, 0])


def test_one_axis_example_clip():
    grid = Grid(shape=(10,), parts=(3,), halo=(1,), boundary="clip")
    assert halo_bounds(grid, 0) == ((slice(0, 5),), ((0, 0),))
    assert halo_bounds(grid, 2) == ((slice(6, 10),), ((0, 0),))
    assert [block_shape(grid, i) for i in range(3)] == [(5,), (5,), (4,)]


def test_three_axis_example():
    grid = Grid(shape=(128, 128, 128), parts=(2, 2, 1), halo=(2, 2, 2))
    assert grid.nblocks == 4
    assert block_coords(grid, 1) == (0, 1, 0) and block_coords(grid, 2) == (1, 0, 0)
    assert block_bounds(grid, 3) == (slice(64, 128), slice(64, 128), slice(0, 128))
    assert halo_bounds(grid, 3) == (
        (slice(62, 128), slice(62, 128), slice(0, 128)),
        ((0, 2), (0, 2), (2, 2)),
    )
    assert block_shape(grid, 3) == (68, 68, 132)
    assert full_region(grid, 0, 4, (1, 2, 3)) == (
        (slice(0, None), slice(0, 66), slice(0, 66), slice(0, 128)),
        ((0, 0), (2, 0), (2, 0), (2, 2)),
    )
    clip = dataclasses.replace(grid, boundary="clip")
    assert block_shape(clip, 3) == (66, 66, 128)


def test_block_numbering_is_c_order():
    grid = Grid(shape=(4, 6), parts=(2, 3))
    assert [block_coords(grid, i) for i in range(6)] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2),
    ]  # fmt: skip
    assert block_index(grid, (1, 0)) == 3


def test_grid_normalizes_and_is_frozen():
    grid = Grid(shape=[8, np.int64(6)], parts=(2, 3))
    assert grid.shape == (8, 6) and grid.halo == (0, 0)
    assert grid == Grid(shape=(8, 6), parts=(2, 3), halo=(0, 0))
    assert hash(grid) == hash(Grid(shape=(8, 6), parts=(2, 3), halo=(0, 0)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        grid.halo = (1, 1)  # type: ignore[misc]


def test_single_block_axis_halo_is_unlimited():
    grid = Grid(shape=(3,), parts=(1,), halo=(5,))
    assert halo_bounds(grid, 0) == ((slice(0, 3),), ((5, 5),))
    assert block_shape(dataclasses.replace(grid, boundary="clip"), 0) == (3,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shape": (3,), "parts": (4,)}, r"parts\[0\]=4 > shape\[0\]=3.*block of length 0"),
        ({"shape": (8, 3), "parts": (2, 4)}, r"parts\[1\]=4 > shape\[1\]=3"),
        ({"shape": (8,), "parts": (0,)}, r"parts\[0\]=0.*at least one block"),
        ({"shape": (0,), "parts": (1,)}, r"shape\[0\]=0"),
        ({"shape": (10,), "parts": (3,), "halo": (4,)}, r"halo\[0\]=4.*direct neighbour"),
        ({"shape": (8, 9), "parts": (1, 3), "halo": (0, 4)}, r"halo\[1\]=4.*smallest"),
        ({"shape": (8,), "parts": (2,), "halo": (-1,)}, r"halo\[0\]=-1.*>= 0"),
        ({"shape": (8,), "parts": (2,), "boundary": "wrap"}, r"boundary.*'wrap'"),
        ({"shape": (8, 8), "parts": (2,)}, r"length mismatch"),
        ({"shape": (8, 8), "parts": (2, 2), "halo": (1,)}, r"length mismatch"),
        ({"shape": (), "parts": ()}, r"at least one spatial axis"),
        ({"shape": (8.0,), "parts": (2,)}, r"shape must be a sequence of ints"),
    ],
)
def test_grid_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Grid(**kwargs)


def test_halo_at_the_limit_is_allowed():
    grid = Grid(shape=(10,), parts=(3,), halo=(3,))
    assert halo_bounds(grid, 1) == ((slice(1, 10),), ((0, 0),))


def test_split_sizes_errors():
    with pytest.raises(ValueError, match="size 3 into 4 parts"):
        split_sizes(3, 4)
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_sizes(3, 0)


def test_index_and_array_errors():
    grid = Grid(shape=(8, 8), parts=(2, 2), halo=(1, 1))
    with pytest.raises(IndexError, match="out of range"):
        block_coords(grid, 4)
    with pytest.raises(IndexError, match="out of range"):
        block_bounds(grid, -1)
    with pytest.raises(IndexError, match=r"coords\[1\]=2"):
        block_index(grid, (0, 2))
    with pytest.raises(ValueError, match="length mismatch"):
        block_index(grid, (0,))
    with pytest.raises(ValueError, match="spatial shape"):
        extract_block(np.zeros((8, 9)), grid, 0)
    with pytest.raises(ValueError, match="needs spatial_axes"):
        extract_block(np.zeros((2, 8, 8)), grid, 0)
    with pytest.raises(ValueError, match="repeat"):
        full_region(grid, 0, 3, (1, 1))
    with pytest.raises(ValueError, match="out of range"):
        full_region(grid, 0, 3, (1, 3))
    with pytest.raises(ValueError, match="out has shape"):
        extract_block(np.zeros((8, 8)), grid, 0, out=np.zeros((4, 4)))
    with pytest.raises(TypeError):  # float into an int buffer is not a same-kind cast
        extract_block(np.zeros((8, 8)), grid, 0, out=np.zeros((6, 6), dtype=np.int32))
    with pytest.raises(ValueError, match="got 3 blocks"):
        assemble([np.zeros((4, 4))] * 3, grid)
    assert full_region(grid, 3, 3, (-2, -1))[0][1:] == (slice(3, 8), slice(3, 8))

"""The delivery core: boxes, padding, the parallel gather, the reuse-safe ring (one process)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.maths.delivery import (
    batch_copies,
    batch_pad_copies,
    box_copies,
    covered,
    delivered_fields,
    parse_spatial,
    spatial_grid,
)
from datastore.maths.partition import extract_block
from datastore.readers.base import FieldInfo
from datastore.service.wire import _Rows
from datastore.store.gather import Gather, fill_batch
from datastore.store.ring import BufferRing


def _info(shape=(2, 8, 6, 4)):
    return {
        "x": FieldInfo(name="x", dtype=np.dtype("float32"), shape=shape, spatial_axes=(1, 2, 3)),
        "y": FieldInfo(name="y", dtype=np.dtype("int64"), shape=(3,), spatial_axes=()),
    }


@settings(max_examples=60, deadline=None)
@given(
    parts=st.tuples(*(st.integers(1, 3),) * 3),
    halo=st.tuples(*(st.integers(0, 2),) * 3),
    boundary=st.sampled_from(["zero", "clip"]),
    threads=st.integers(1, 3),
)
def test_a_filled_box_equals_the_reference_block_even_over_garbage(parts, halo, boundary, threads):
    info = _info()
    spatial = {"parts": parts, "halo": halo, "boundary": boundary}
    try:
        grid = spatial_grid(info, spatial)
    except ValueError:
        return  # a halo wider than a block: refused, as Grid documents
    rng = np.random.default_rng(0)
    vols = {n: rng.standard_normal((4, *fi.shape)).astype(fi.dtype) for n, fi in info.items()}
    gather = Gather(threads)
    for k in range(grid.nblocks):
        fields = delivered_fields(info, grid, k)
        out = {f.name: np.full((3, *f.shape), 99, f.dtype) for f in fields}  # a reused buffer
        fill_batch([2, 0, 3], fields, lambda i, n: vols[n][i], out, gather=gather)
        for pos, i in enumerate([2, 0, 3]):
            want = extract_block(vols["x"][i], grid, k, (1, 2, 3))
            assert np.array_equal(out["x"][pos], want)
            assert np.array_equal(out["y"][pos], vols["y"][i])
    gather.close()


def test_fetched_parts_and_boxes_fill_as_the_samples_do_zero_halo_once_per_slab():
    """Samples from other nodes (a whole box, or its part inside the volume) fill a reused
    batch as local ones do, and the halo outside the volume takes one fill per slab for the
    whole batch (a batch array), or one per slab and position (rows of separate arrays)."""
    info = _info((2, 8, 6, 4))
    grid = spatial_grid(info, {"parts": (2, 1, 1), "halo": (1, 1, 1)})
    rng = np.random.default_rng(1)
    vols = {n: rng.standard_normal((4, *fi.shape)).astype(fi.dtype) for n, fi in info.items()}
    for k in range(grid.nblocks):
        fields = delivered_fields(info, grid, k)
        x = next(f for f in fields if f.name == "x")
        whole = extract_block(vols["x"][3], grid, k, (1, 2, 3))
        fetched = {(3, "x"): whole, (0, "x"): vols["x"][0][covered(x)[0]]}
        out = {f.name: np.full((4, *f.shape), 99, f.dtype) for f in fields}
        copies = batch_copies([2, 0, 3], fields, lambda i, n: vols[n][i], out, fetched)
        pads = [c for c in copies if c[1] is None]
        assert len(pads) == 5  # y below (or above), z and x on both sides: 5 slabs, 3 samples
        Gather(1).run(copies)
        for pos, i in enumerate([2, 0, 3]):
            assert np.array_equal(out["x"][pos], extract_block(vols["x"][i], grid, k, (1, 2, 3)))
        assert (out["x"][3] == 99).all()  # past the batch's samples: untouched
        rows = [np.full(x.shape, 99, np.float32) for _ in range(3)]
        per_row = batch_pad_copies(x, _Rows(rows), 3)  # (a batch cut across messages)
        assert len(per_row) == 15
        Gather(1).run(per_row)
        for r in rows:
            inner = r[covered(x)[1]]
            assert (inner == 99).all() and (r == 0).sum() == r.size - inner.size
        skipped = np.full((4, *x.shape), 99, np.float32)
        some = batch_pad_copies(x, skipped, 4, frozenset({1}))  # position 1: the link's own
        assert len(some) == 2 * 5  # positions 0 and 2-3: two runs, 5 slabs each
        Gather(1).run(some)
        assert (skipped[1] == 99).all()
        for pos in (0, 2, 3):
            box = skipped[pos]
            inner = box[covered(x)[1]]
            assert (inner == 99).all() and (box == 0).sum() == box.size - inner.size


def test_covered_is_the_part_inside_the_volume():
    grid = spatial_grid(_info((1, 10, 4, 4)), {"parts": (3, 1, 1), "halo": 1})
    f = delivered_fields(_info((1, 10, 4, 4)), grid, 0)[0]
    assert f.shape == (1, 6, 6, 6) and f.origin == (0, -1, -1, -1)
    src, dst = covered(f)
    assert src == (slice(0, 1), slice(0, 5), slice(0, 4), slice(0, 4))
    assert dst == (slice(0, 1), slice(1, 6), slice(1, 5), slice(1, 5))
    copies = box_copies(f, np.empty(f.shape, np.float32), np.zeros((1, 10, 4, 4), np.float32))
    assert sum(d.size for d, _ in copies) == 6 * 6 * 6  # every voxel written exactly once


def test_gather_splits_large_copies_and_copies_exactly():
    src = np.arange(8 * 1024 * 1024, dtype=np.float32).reshape(64, -1)
    dst = np.zeros_like(src)
    Gather(2).run([(dst, src), (np.zeros(3), None)])
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError, match="threads"):
        Gather(0)


class _Counted(ThreadPoolExecutor):
    """A real pool that counts the work handed to it."""

    handed = 0

    def submit(self, *args, **kwargs):
        self.handed += 1
        return super().submit(*args, **kwargs)


def test_gather_copies_a_few_small_pieces_on_the_calling_thread():
    """A block's zero halo (a few faces of KiB) is not worth waking a thread for; megabytes are."""
    gather = Gather(2)
    gather._pool = _Counted(1)
    faces = [(np.ones((4, 1, 66, 66), np.float32), None) for _ in range(10)]
    gather.run(faces)
    assert gather._pool.handed == 0 and all(not d.any() for d, _ in faces)
    src = np.arange(2 * 1024 * 1024, dtype=np.float32).reshape(8, -1)  # 8 MiB
    dst = np.zeros_like(src)
    gather.run([(dst, src)])
    assert gather._pool.handed == 1 and np.array_equal(dst, src)
    gather.close()


@pytest.mark.parametrize(
    ("spatial", "match"),
    [
        ({"halo": (1, 1, 1)}, "parts"),
        ({"parts": (2, 0, 1)}, "parts"),
        ({"parts": (2, 1, 1), "halo": (1, 1)}, "halo"),
        ({"parts": (2, 1, 1), "halo": "1"}, "halo"),
        ({"parts": (2, 1, 1), "edge": 1}, "edge"),
        ({"parts": (2, 1, 1), "boundary": "wrap"}, "boundary"),
        ((2, 1, 1), "dict"),
    ],
)
def test_malformed_spatial_is_a_value_error_naming_the_key(spatial, match):
    with pytest.raises(ValueError, match=match):
        parse_spatial(spatial)


def test_an_int_halo_is_every_axis():
    assert parse_spatial({"parts": (2, 1, 1), "halo": 1}) == {
        "parts": (2, 1, 1),
        "halo": (1, 1, 1),
        "boundary": "zero",
    }


def test_the_ring_reuses_a_buffer_only_when_nobody_holds_it():
    fields = delivered_fields(_info(), None, 0)
    ring = BufferRing(fields, 2, keep=2)
    a = ring.take()
    held = a.views()["x"][0]  # a view of one sample keeps the buffer
    b = ring.take()
    assert b is not a
    b.views()  # dropped at once
    assert ring.take() is b
    c = ring.take()
    assert c is not a and c is not b
    del held
    c.views()
    assert ring.take() is a
    assert torch.equal(a.tensors["x"], torch.zeros_like(a.tensors["x"]))


def test_a_failed_copy_returns_only_once_the_other_threads_are_done():
    """The calling thread's copy fails at once; the pool's share (32 MiB) is still being
    written: run must raise only after it, or the batch is written behind the caller's back."""
    src = np.arange(16 << 20, dtype=np.float32).reshape(16, -1)  # 64 MiB, cut into 4 pieces
    for _ in range(3):
        dst = np.zeros_like(src)
        bad = (np.zeros(2, np.float32), np.zeros(3, np.float32))  # cannot broadcast
        gather = Gather(2)
        try:
            with pytest.raises(ValueError):
                gather.run([bad, (dst, src)])
            assert np.array_equal(dst[8:], src[8:]), "the pool's copies still ran after run"
        finally:
            gather.close()


def test_a_split_of_2d_samples_names_the_fields_and_the_spec_key():
    """(N, H, W) samples have no default spatial axes: the refusal named no field and no way
    out ("a spatial layout was given but no delivered field has spatial axes")."""
    info = {
        "x": FieldInfo(name="x", dtype=np.dtype("float32"), shape=(9, 10), spatial_axes=()),
        "y": FieldInfo(name="y", dtype=np.dtype("int64"), shape=(), spatial_axes=()),
    }
    with pytest.raises(ValueError) as err:
        spatial_grid(info, {"parts": (2, 2), "halo": 1})
    assert str(err.value) == (
        "a spatial layout was given but no delivered field has spatial axes (x (9, 10), y () "
        "per sample): by default they are the last three axes of a field of three or more; "
        "name them in a spec file (fields = [{name, spatial_axes}])"
    )


def test_spatial_fields_of_different_volumes_are_named():
    """A (C, D, H, W) volume beside a (H, W, 3) image: both have default spatial axes, and the
    refusal listed the volumes, [(5, 6, 7), (9, 9, 3)], not the fields nor what to do."""
    info = {
        "x": FieldInfo(
            name="x", dtype=np.dtype("float32"), shape=(2, 5, 6, 7), spatial_axes=(1, 2, 3)
        ),
        "img": FieldInfo(
            name="img", dtype=np.dtype("uint8"), shape=(9, 9, 3), spatial_axes=(0, 1, 2)
        ),
    }
    with pytest.raises(ValueError) as err:
        spatial_grid(info, {"parts": (1, 2, 1), "halo": 1})
    assert str(err.value) == (
        "spatial fields have different volumes (x (5, 6, 7), img (9, 9, 3)): leave out the "
        "fields not to split (fields=[...]), or name the spatial axes in a spec file"
    )

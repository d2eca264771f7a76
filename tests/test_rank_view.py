"""One rank's view (``datastore.maths.rank_view``): the layout, the schedule and the fields agree
over the ranks of a job, and every bad argument is refused by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.maths.order import state
from datastore.maths.ownership import RangeOwners
from datastore.maths.rank_view import global_batch, rank_view
from datastore.readers.base import FieldInfo


def _info(side: int) -> dict[str, FieldInfo]:
    return {
        "x": FieldInfo("x", np.dtype("<f4"), (2, side, side), (1, 2)),
        "y": FieldInfo("y", np.dtype("<i8"), (3,)),
    }


@st.composite
def jobs(draw):
    """A valid job: spatial blocks, data ranks, a global batch they divide, a dataset."""
    parts = draw(st.sampled_from([None, (1, 1), (2, 1), (2, 2)]))
    blocks = math.prod(parts) if parts else 1
    data_world = draw(st.integers(1, 4))
    local = draw(st.integers(1, 3))
    drop_last = draw(st.booleans())
    low = data_world * local if drop_last else 1
    num_samples = draw(st.integers(low, 40))
    shuffle = draw(st.sampled_from([True, False, "shard", "window:3"]))
    if shuffle in ("shard", "window:3"):  # every home must fill one batch when dropping
        num_samples = max(num_samples, data_world * (local + 1) if drop_last else data_world)
    spatial = {"parts": parts, "halo": draw(st.integers(0, 1))} if parts else None
    return {
        "world": data_world * blocks,
        "global_batch_size": data_world * local,
        "num_samples": num_samples,
        "seed": draw(st.integers(0, 2**31)),
        "shuffle": shuffle,
        "drop_last": drop_last,
        "spatial": spatial,
    }


def _same(a, b) -> bool:
    """Equal views (homes compared by their digest)."""
    return (a.grid, a.layout, a.fields, a.local_batch) == (
        b.grid, b.layout, b.fields, b.local_batch
    ) and state(a.schedule, 0, 0) == state(b.schedule, 0, 0)  # fmt: skip


def _views(job: dict) -> list:
    args = {k: v for k, v in job.items() if k != "num_samples"}
    return [rank_view(_info(8), job["num_samples"], rank=r, **args) for r in range(job["world"])]


@settings(deadline=None, max_examples=80)
@given(jobs())
def test_ranks_share_one_schedule_and_split_each_step(job):
    views = _views(job)
    first = views[0]
    assert all(_same(v.of_rank(0), first) for v in views)
    lay = first.layout
    assert first.local_batch * lay.data_world == job["global_batch_size"]
    for v in views:  # spatial-fastest: rank = data_rank * S + spatial_rank
        assert v.layout.data_rank * v.layout.spatial_size + v.layout.spatial_rank == v.layout.rank
        assert list(v.fields) == v.fields_of(v.layout.spatial_rank)
        assert v.local_batch == first.local_batch
    sched, steps = first.schedule, first.schedule.steps_per_epoch
    assert steps >= 1
    seen = []
    for step in range(steps):
        # the ranks of one data rank get the same samples; data ranks split the step
        per_data = [
            views[d * lay.spatial_size].schedule.rank_samples(1, step, d, lay.data_world)
            for d in range(lay.data_world)
        ]
        assert all(len(s) == first.local_batch for s in per_data)
        seen.append(np.concatenate(per_data))
    seen = np.concatenate(seen)
    n = job["num_samples"]
    assert seen.min() >= 0 and seen.max() < n
    if job["shuffle"] in (True, False):
        if job["drop_last"]:  # each sample at most once
            assert len(np.unique(seen)) == len(seen) == steps * job["global_batch_size"]
        else:  # every sample at least once
            assert set(seen.tolist()) == set(range(n))
    else:  # each data rank draws from its own contiguous home only
        homes = first.schedule.homes
        for d in range(lay.data_world):
            mine = sched.rank_epoch(1, d, lay.data_world).reshape(-1)
            assert set(mine.tolist()) <= set(homes.keys_of(d).tolist())


@settings(deadline=None, max_examples=60)
@given(jobs())
def test_of_rank_and_batch_size_give_the_same_view(job):
    views = _views(job)
    for r, v in enumerate(views):
        assert _same(views[0].of_rank(r), v)
    data_world = views[0].layout.data_world
    per_rank = {**job, "batch_size": job["global_batch_size"] // data_world}
    del per_rank["global_batch_size"], per_rank["num_samples"]
    again = rank_view(_info(8), job["num_samples"], rank=job["world"] - 1, **per_rank)
    assert _same(again, views[-1])


@settings(deadline=None, max_examples=60)
@given(jobs())
def test_blocks_tile_each_spatial_field(job):
    v = _views(job)[0]
    parts = job["spatial"]["parts"] if job["spatial"] else (1, 1)
    by_block = [v.fields_of(k) for k in range(math.prod(parts))]
    halo = job["spatial"]["halo"] if job["spatial"] else 0
    for x, y in by_block:
        assert (y.shape, y.blocked) == ((3,), False)  # not spatial: whole, in every block
        assert x.shape[0] == 2 and x.sample_shape == (2, 8, 8)
    # along each spatial axis the blocks tile the volume, each padded by the (zero) halo
    for axis, p in zip((1, 2), parts, strict=True):
        step = math.prod(parts[axis:])  # blocks numbered last-axis-fastest
        edges = [by_block[k * step][0] for k in range(p)]
        assert sum(f.shape[axis] for f in edges) == 8 + 2 * halo * p


def test_shard_homes_follow_the_owners():
    owner = RangeOwners(10, 4)  # 3, 3, 2, 2 samples: data rank 0 holds 6, data rank 1 holds 4
    view = rank_view(
        _info(8), 10, rank=0, world=4, global_batch_size=2, shuffle="shard",
        spatial={"parts": (2, 1)}, owner=owner, drop_last=False,
    )  # fmt: skip
    assert view.schedule.homes.sizes.tolist() == [6, 4]
    plain = rank_view(_info(8), 10, rank=0, world=2, global_batch_size=2, shuffle="shard")
    assert plain.schedule.homes.sizes.tolist() == [5, 5]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"world": 3, "global_batch_size": 4}, "not divisible by 3 data-parallel ranks"),
        ({"world": 3, "batch_size": 1, "spatial": {"parts": (2, 1)}}, "not a multiple of 2"),
        (
            {"world": 2, "global_batch_size": 20, "drop_last": True},
            r"exceeds the 10 samples: with drop_last=True an epoch would have no batch \(use a "
            r"smaller batch, or drop_last=False",
        ),
        (
            {"world": 2, "global_batch_size": 12, "shuffle": "shard"},
            r"data rank 0 draws only from the 5 samples its ranks hold, fewer than its 6 per "
            r"step: with drop_last=True an epoch would have no batch \(use a smaller batch, "
            r"drop_last=False or shuffle='global'\)",
        ),
        ({"world": 1, "global_batch_size": 2, "shuffle": "sideways"}, "shuffle must be"),
        ({"world": 1}, "give exactly one of batch_size"),
        ({"world": 1, "batch_size": 1, "global_batch_size": 1}, "give exactly one"),
        ({"world": 2, "batch_size": 1, "spatial": {"parts": (1, 1, 2)}}, "has 3 axes"),
    ],
)
def test_bad_arguments_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        rank_view(_info(8), 10, rank=0, **kw)


def test_global_batch():
    assert global_batch(3, None, 8, {"parts": (2, 2)}) == 6
    assert global_batch(None, 12, 8) == 12

"""A rank's plan of a step is exactly its share of the whole step's plan, in the same order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.exchange import EpochPlan, plan, rank_plan
from datastore.order import Schedule, rank_layout
from datastore.ownership import Homes, RangeOwners, owned_keys


@settings(deadline=None, max_examples=80)
@given(
    st.integers(1, 4),  # data ranks
    st.integers(1, 4),  # spatial blocks
    st.integers(1, 6),  # samples per data rank
    st.integers(0, 2**31),
)
def test_rank_plan_is_the_ranks_share_of_the_plan(data_world, spatial, per_rank, seed):
    rng = np.random.default_rng(seed)
    world = data_world * spatial
    n = data_world * per_rank + int(rng.integers(0, 10))
    owner = rng.integers(0, world, n)
    batch = rng.permutation(n)[: data_world * per_rank]
    every = plan(batch, owner, data_world, spatial)
    for rank in range(world):
        mine = [m for m in every if rank in (m.src, m.dst)]
        assert rank_plan(batch, owner, data_world, spatial, rank) == mine


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1), (1, 3), (4, 2)]),
    st.integers(1, 4),
    st.sampled_from(["global", "none", "shard", "window:3"]),
    st.sampled_from(["drop", "pad"]),
    st.integers(0, 3),
)
def test_an_epoch_plan_lists_exactly_the_messages_of_the_global_batch(
    n, grid, per_rank, shuffle, tail, epoch
):
    """Every rank's messages, from its own share only, equal ``rank_plan`` of the whole global
    batch: for every step, shuffle, tail and padding."""
    data_world, spatial = grid
    world, gb = data_world * spatial, data_world * per_rank
    owner = RangeOwners(n, world)
    homes = Homes(owner, data_world, spatial) if shuffle in ("shard", "window:3") else None
    try:
        sched = Schedule(n, gb, seed=3, shuffle=shuffle, tail=tail, homes=homes)
    except ValueError:
        return  # a batch larger than the data (or a home) with tail="drop": refused
    for rank in range(world):
        lay = rank_layout(rank, world, spatial)
        ep = EpochPlan(sched, owner, lay, epoch, owned_keys(owner, rank))
        for step in range(sched.steps_per_epoch):
            batch = sched.global_batch_at(epoch, step)
            assert ep.messages(step) == rank_plan(batch, owner, data_world, spatial, rank)

"""A rank's plan of a step is exactly its share of the whole step's plan, in the same order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.maths.exchange import EpochPlan, Message, plan, rank_plan
from datastore.maths.order import Schedule, rank_layout
from datastore.maths.ownership import Homes, RangeOwners, RunOwners, owned_keys


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


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([(1, 1), (2, 1), (2, 2), (3, 1), (1, 3), (4, 2)]),
    st.integers(1, 4),
    st.sampled_from(["global", "none"]),
    st.sampled_from(["drop", "pad"]),
    st.integers(0, 2**31),
)
def test_an_epoch_plan_over_runs_of_any_owners_lists_the_messages_of_the_global_batch(
    n, grid, per_rank, shuffle, tail, seed
):
    """A shard layout's owners (runs of files on any ranks, some ranks holding none), given as
    runs or as an owner per sample: each step's messages equal ``rank_plan``'s."""
    data_world, spatial = grid
    world, gb = data_world * spatial, data_world * per_rank
    rng = np.random.default_rng(seed)
    every = rng.integers(0, world, n)
    cuts = np.sort(rng.choice(np.arange(1, n + 1), size=min(n, 3), replace=False))
    starts = np.concatenate([[0], cuts[:-1]])
    runs = RunOwners(starts, rng.integers(0, world, len(starts)), n)
    try:
        sched = Schedule(n, gb, seed=seed, shuffle=shuffle, tail=tail)
    except ValueError:
        return
    for owner in (runs, every):
        for rank in range(world):
            ep = EpochPlan(
                sched, owner, rank_layout(rank, world, spatial), 1, owned_keys(owner, rank)
            )
            assert ep.steps == sched.steps_per_epoch
            for step in range(sched.steps_per_epoch):
                batch = sched.global_batch_at(1, step)
                assert ep.messages(step) == rank_plan(batch, owner, data_world, spatial, rank)


def test_a_steps_messages_read_as_a_list_of_messages():
    """``messages(step)`` is a sequence of ``Message``: length, index, slice, iteration."""
    sched = Schedule(12, 4, seed=5)
    owner = RangeOwners(12, 2)
    ep = EpochPlan(sched, owner, rank_layout(0, 2), 0, owned_keys(owner, 0))
    msgs = ep.messages(1)
    want = rank_plan(sched.global_batch_at(0, 1), owner, 2, 1, 0)
    assert list(msgs) == want and len(msgs) == len(want)
    assert msgs[0] == want[0] and isinstance(msgs[0], Message) and msgs[-1] == want[-1]
    assert list(msgs[1:3]) == want[1:3]
    assert [m.sample for m in msgs] == [m.sample for m in want]
    with pytest.raises(IndexError, match=r"step 3 outside 0\.\.2"):
        ep.messages(3)


def test_a_ranks_exchange_plan_at_a_billion_samples_on_65536_ranks_stays_small():
    """The issue's scale: 10^9 samples on 65,536 ranks, rank 0's exchange plan for a whole
    epoch under 64 MiB (measured: about 5 MiB; its time is ``benchmarks/scale.py``'s), and one
    step's messages those of the whole global batch."""
    import tracemalloc

    n, ranks = 10**9, 65536
    sched = Schedule(n, 4 * ranks, seed=1)
    owner = RangeOwners(n, ranks)
    tracemalloc.start()
    ep = EpochPlan(sched, owner, rank_layout(0, ranks), 3, owner.keys_of(0))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert ep.nbytes < 4 << 20, ep.nbytes
    step = 1234
    want = rank_plan(sched.global_batch_at(3, step), owner, ranks, 1, 0)
    assert ep.messages(step) == want and len(want) >= 4

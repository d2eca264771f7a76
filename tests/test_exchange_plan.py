"""A rank's plan of a step is exactly its share of the whole step's plan, in the same order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.exchange import plan, rank_plan


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

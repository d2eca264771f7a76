"""The shuffle knob: ``global``, ``shard`` and ``window:K`` orders, homes and runs of owners."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore import DataStoreLoader
from datastore.maths.order import Schedule, check_state, home_order, parse_shuffle, state
from datastore.maths.ownership import FEW, Homes, RangeOwners, RunOwners, contiguous_owners
from datastore.store.shards import owners_by_holders


def test_parse_shuffle_canonical_forms_and_refusals():
    assert [parse_shuffle(v) for v in (True, False, "global", " Shard ", "none")] == [
        "global",
        "none",
        "global",
        "shard",
        "none",
    ]
    assert parse_shuffle("window:08") == "window:8"
    for bad in ("window", "window:0", "window:-2", "window:x", "random", 1, None):
        with pytest.raises(ValueError, match="shuffle must be"):
            parse_shuffle(bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.integers(0, 9), st.integers(0, 6))
def test_home_order_is_a_bijection_of_every_home(sizes, epoch, window):
    sizes = np.asarray(sizes, dtype=np.int64)
    for d, n in enumerate(sizes.tolist()):
        got = home_order(np.full(n, d), np.arange(n), sizes, 7, epoch, window)
        assert sorted(got.tolist()) == list(range(n))
        again = home_order(np.full(n, d), np.arange(n), sizes, 7, epoch, window)
        assert np.array_equal(got, again)  # a pure function of (seed, epoch, rank)


def test_home_orders_differ_by_rank_epoch_and_seed():
    sizes = np.array([50, 50])
    j = np.arange(50)
    a = home_order(np.zeros(50, np.int64), j, sizes, 1, 0, 0)
    assert not np.array_equal(a, home_order(np.ones(50, np.int64), j, sizes, 1, 0, 0))
    assert not np.array_equal(a, home_order(np.zeros(50, np.int64), j, sizes, 1, 1, 0))
    assert not np.array_equal(a, home_order(np.zeros(50, np.int64), j, sizes, 2, 0, 0))


@pytest.mark.parametrize("n,k", [(40, 8), (43, 8), (7, 3), (5, 9)])
def test_a_window_is_k_consecutive_samples_of_the_home(n, k):
    """``window:K`` hands out the home in windows of K consecutive samples (cyclically, after
    the rotation), each shuffled; whole windows first, the partial one last."""
    got = home_order(np.zeros(n, np.int64), np.arange(n), np.array([n]), 3, 2, k)
    for start in range(0, n, k):
        w = np.sort(got[start : start + k])
        size = len(w)
        # a cyclic interval of `size` consecutive indices modulo n
        gaps = np.diff(np.concatenate([w, [w[0] + n]]))
        assert sorted(gaps.tolist()) == [1] * (size - 1) + [n - size + 1], (start, w)
    if n > k:  # the windows are not visited in storage order every time
        firsts = [int(got[s]) // k for s in range(0, n - n % k, k)]
        assert len(set(firsts)) > 1


def test_run_owners_merge_look_up_and_list():
    own = RunOwners.of_array([0, 0, 1, 1, 1, 0, 2, 2])
    assert own.starts.tolist() == [0, 2, 5, 6] and own.ranks.tolist() == [0, 1, 0, 2]
    assert own[np.arange(8)].tolist() == [0, 0, 1, 1, 1, 0, 2, 2] and own[5] == 0
    assert own.keys_of(0).tolist() == [0, 1, 5] and own.keys_of(3).tolist() == []
    assert own.counts(4).tolist() == [3, 3, 2, 0]
    with pytest.raises(IndexError):
        own[8]
    with pytest.raises(ValueError, match="start at sample 0"):
        RunOwners([1], [0], 4)
    assert RangeOwners(3, 5).counts(5).tolist() == [1, 1, 1, 0, 0]  # empty ranks have no run


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=200), st.data())
def test_a_few_samples_are_looked_up_as_many_are(owner, data):
    """A batch's few samples are looked up in Python (``owners_of``, and ``[]`` of up to
    ``FEW``), many by numpy: both say the owner each sample has."""
    own, n = RunOwners.of_array(owner), len(owner)
    picked = data.draw(st.lists(st.integers(0, n - 1), max_size=2 * FEW))
    assert own.owners_of(picked) == [owner[i] for i in picked]
    got = own[np.asarray(picked, dtype=np.int64)]
    assert isinstance(got, np.ndarray) and got.tolist() == [owner[i] for i in picked]
    assert own[np.arange(n)].tolist() == owner and all(own[i] == owner[i] for i in picked[:3])
    assert isinstance(own[np.int64(n - 1)], int)
    for outside in (-1, n):
        with pytest.raises(IndexError, match=f"outside 0..{n - 1}"):
            own.owners_of([0, outside])
        with pytest.raises(IndexError):
            own[np.asarray([outside])]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3)), min_size=1, max_size=12),
    st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_owners_by_holders_as_runs_equal_the_per_sample_rule(files, per_node):
    """Files go to the first node holding them; a node's samples split in contiguous ranges
    over its ranks: the runs say exactly what an owner per sample would."""
    nodes = len(per_node)
    names = [f"f{i:02d}" for i in range(len(files))]
    counts = [c for c, _ in files]
    holders = []
    for node, ranks in enumerate(per_node):
        held = [nm for nm, (_, where) in zip(names, files, strict=True) if where % nodes == node]
        holders += [held] * ranks
    if not any(holders):
        return
    names = sorted({n for h in holders for n in h})
    counts = [counts[int(n[1:])] for n in names]
    starts = np.concatenate([[0], np.cumsum(counts)])
    want = np.full(int(starts[-1]), -1)
    rank0 = 0
    for ranks in per_node:  # the reference: an owner per sample
        held = holders[rank0]
        samples = np.concatenate(
            [np.arange(starts[k], starts[k + 1]) for k, n in enumerate(names) if n in held]
            or [np.zeros(0, np.int64)]
        )
        want[samples] = rank0 + contiguous_owners(len(samples), ranks)
        rank0 += ranks
    got = owners_by_holders(names, holders, counts)
    assert got[np.arange(len(want))].tolist() == want.tolist()
    for r in range(rank0):
        assert got.keys_of(r).tolist() == np.flatnonzero(want == r).tolist()


def test_homes_group_a_data_ranks_spatial_ranks_in_storage_order():
    own = RunOwners.of_array([2, 2, 0, 1, 3, 3, 1, 0, 2])  # ranks 0,1: data rank 0; 2,3: 1
    homes = Homes(own, data_world=2, spatial_size=2)
    assert homes.sizes.tolist() == [4, 5]
    assert homes.keys_of(0).tolist() == [2, 3, 6, 7]
    assert homes.keys_of(1).tolist() == [0, 1, 4, 5, 8]
    assert homes.sample([1, 0], [4, 0]).tolist() == [8, 2]
    assert Homes.contiguous(10, 3).keys_of(2).tolist() == [7, 8, 9]


def test_the_exchanges_owners_give_each_data_rank_its_contiguous_home():
    """The exchange's owners over ``D`` data ranks of ``S`` spatial ranks make the homes of
    the local source and the service (``Homes.contiguous``): the same ``shard`` batches and
    ``len()``. ``RangeOwners(10, 4)`` held 3, 3, 2, 2 samples: homes of 6 and 4 at
    ``parts=(2, 1, 1)``, where the service's are 5 and 5 (len 6 against 5 at batch 1)."""
    assert RangeOwners(10, 4, 2).counts(4).tolist() == [3, 2, 3, 2]
    for n in range(13):
        for data_world, spatial in ((1, 3), (2, 2), (3, 2), (2, 1), (4, 1)):
            world = data_world * spatial
            homes = Homes(RangeOwners(n, world, data_world), data_world, spatial)
            plain = Homes.contiguous(n, data_world)
            for d in range(data_world):
                assert homes.keys_of(d).tolist() == plain.keys_of(d).tolist(), (n, d, spatial)
            if spatial == 1:  # whole samples: the split is as it was
                assert RangeOwners(n, world, data_world).counts(world).tolist() == [
                    len(RangeOwners(n, world).keys_of(r)) for r in range(world)
                ]


@pytest.mark.parametrize("shuffle", ["shard", "window:3"])
@pytest.mark.parametrize("tail", ["drop", "pad"])
def test_a_local_shuffle_keeps_every_data_rank_in_its_home(shuffle, tail):
    own = RunOwners.of_array([0] * 10 + [1] * 7 + [2] * 9)
    homes = Homes(own, data_world=3)
    sched = Schedule(26, 6, seed=4, shuffle=shuffle, tail=tail, homes=homes)
    assert sched.steps_per_epoch == (3 if tail == "drop" else 5)  # 7 // 2, 10 / 2
    for epoch in range(2):
        whole = sched.order(epoch).reshape(sched.steps_per_epoch, 6)
        for d in range(3):
            mine = sched.rank_epoch(epoch, d, 3)
            assert np.array_equal(mine, whole[:, 2 * d : 2 * d + 2])
            assert set(mine.ravel().tolist()) <= set(homes.keys_of(d).tolist())
            for step in range(sched.steps_per_epoch):
                assert np.array_equal(sched.rank_samples(epoch, step, d, 3), mine[step])
            if tail == "pad":  # every home sample once among the real ones; repeats marked
                valid = np.stack([sched.valid(s, d, 3) for s in range(sched.steps_per_epoch)])
                real = mine[valid]
                assert sorted(real.tolist()) == homes.keys_of(d).tolist()
                assert valid.sum() == homes.sizes[d]
            else:  # distinct, from the home
                assert len(set(mine.ravel().tolist())) == mine.size
    assert not np.array_equal(sched.order(0), sched.order(1))


def test_a_local_shuffle_refuses_homes_too_small_or_empty_and_foreign_worlds():
    own = RunOwners.of_array([0] * 10 + [1] * 1)
    with pytest.raises(ValueError, match="data rank 1 draws only from the 1 samples"):
        Schedule(11, 4, shuffle="shard", homes=Homes(own, 2))
    Schedule(11, 4, shuffle="shard", tail="pad", homes=Homes(own, 2))
    with pytest.raises(ValueError, match=r"data rank 2 would draw .* they hold none"):
        Schedule(11, 3, shuffle="shard", tail="pad", homes=Homes(own, 3))
    with pytest.raises(ValueError, match="needs homes"):
        Schedule(11, 2, shuffle="window:4")
    with pytest.raises(ValueError, match="takes no homes"):
        Schedule(11, 2, shuffle=True, homes=Homes(own, 2))
    sched = Schedule(11, 2, shuffle="shard", tail="pad", homes=Homes(own, 2))
    with pytest.raises(ValueError, match="homes are for 2 data-parallel ranks, not 1"):
        sched.rank_samples(0, 0, 0, 1)


def test_resuming_refuses_other_homes_and_reads_old_true():
    a = Schedule(12, 4, shuffle="shard", homes=Homes.contiguous(12, 2))
    b = Schedule(12, 4, shuffle="shard", homes=Homes(RunOwners.of_array([0] * 5 + [1] * 7), 2))
    assert check_state(a, state(a, 3, 1)) == (3, 1)
    with pytest.raises(ValueError, match="other shards"):
        check_state(b, state(a, 3, 1))
    g = Schedule(12, 4)
    old = {**state(g, 2, 1), "shuffle": True, "version": 1}  # saved before the knob
    del old["homes"]
    assert check_state(g, old) == (2, 1)
    with pytest.raises(ValueError, match="shuffle"):
        check_state(a, state(g, 0, 0))


def test_the_local_source_holds_only_its_home_with_shard(tmp_path):
    """Ranks reading for themselves (no exchange) with ``shuffle="shard"`` read and keep only
    their contiguous share: each sample once per epoch over the ranks, none twice."""
    import h5py

    x = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = x
    seen = []
    for rank in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # two ranks, no exchange: known
            loader = DataStoreLoader(
                str(tmp_path / "d.h5"), batch_size=3, rank=rank, world=2, shuffle="shard"
            )
        with loader:
            assert sorted(loader.store.keys.tolist()) == list(range(12 * rank, 12 * rank + 12))
            got = [int(v) // 3 for b in loader for v in b["x"][:, 0].tolist()]
            assert sorted(got) == list(range(12 * rank, 12 * rank + 12))
            seen += got
            assert loader.store.counters.bytes_read == 12 * 3 * 4  # its 12 samples, once
    assert sorted(seen) == list(range(24))


@pytest.mark.parametrize(
    ("shuffle", "drop_last", "parts"),
    [("shard", True, None), ("window:3", False, None), ("shard", False, (2, 1, 1))],
)
def test_shard_and_window_shuffles_through_the_service_are_the_embedded_order(
    tmp_path, shuffle, drop_last, parts
):
    """``datastore serve`` gives each rank of two data ranks (of two spatial blocks each with
    ``parts``) exactly the batches (and padding masks) the embedded loader gives it with
    ``shard`` and ``window:K``, over two epochs."""
    import os

    import h5py
    from helpers import serving

    from datastore.sources.options import ServiceOptions
    from staging.cluster import LAUNCH_ENV

    # every voxel of sample i is i; homes of 14 and 13 samples
    x = np.broadcast_to(np.arange(27, dtype=np.float32)[:, None, None, None], (27, 2, 2, 2))
    spatial = {"parts": parts} if parts else None
    world = 4 if parts else 2
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = x
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)

    def passes(**kw) -> list:
        out = []
        for rank in range(world):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # ranks without exchange: known
                loader = DataStoreLoader(
                    str(tmp_path / "d.h5"), batch_size=4, rank=rank, world=world, seed=5,
                    shuffle=shuffle, drop_last=drop_last, spatial=spatial, **kw,
                )  # fmt: skip
            with loader:
                for e in (0, 1):
                    loader.set_epoch(e)
                    for b in loader:
                        valid = b["valid"].tolist() if "valid" in b else None
                        ids = b["x"].reshape(len(b["x"]), -1)[:, 0].int().tolist()
                        out.append((rank, e, tuple(b["x"].shape), ids, valid))
        return out

    embedded = passes()
    with serving(tmp_path, env) as sock:
        remote = passes(service=ServiceOptions(str(sock)))
    assert remote == embedded
    homes = ({*range(14)}, {*range(14, 27)})
    data_rank = [r * 2 // world for r in range(world)]
    assert all(set(ids) <= homes[data_rank[r]] for r, _, _, ids, _ in embedded)
    assert len(embedded) == world * 2 * (3 if drop_last else 4)
    assert {shape for _, _, shape, _, _ in embedded} == {(4, 1, 2, 2) if parts else (4, 2, 2, 2)}

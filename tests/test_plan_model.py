"""The model behind ``datastore plan``: exact figures on hand-worked cases, and the exchange
share checked against the real epoch order."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from datastore.maths.order import Schedule, rank_layout
from datastore.maths.partition import Grid, block_shape
from datastore.plan.plan_model import (
    DatasetSize,
    Job,
    Machine,
    PlanError,
    Split,
    exchange_cost,
    layouts,
    make_plan,
    offnode_home_share,
    shard_loads,
    split_cost,
    split_ladder,
    stage_time,
    storage_order_link,
)
from datastore.readers.base import FieldInfo
from staging.plan import split_by_bytes

GIB, MIB = 1 << 30, 1 << 20


def volume(samples: int, shape=(4, 8, 8, 8), files: int = 0) -> DatasetSize:
    return DatasetSize(samples, (FieldInfo("x", np.float32, shape, (1, 2, 3)),), files=files)


def flat(samples: int, nbytes: int, files: int = 0) -> DatasetSize:
    return DatasetSize(samples, (FieldInfo("b", np.uint8, (nbytes,)),), files=files)


def machine(**kw) -> Machine:
    base = {
        "nodes": 4,
        "ranks_per_node": 2,
        "gpus_per_node": 2,
        "memory_per_node": 64 * GIB,
        "gpu_memory": 16 * GIB,
        "nvme_per_node": 1024 * GIB,
        "pfs_read_bw": 2 * GIB,
        "nvme_write_bw": 1 * GIB,
        "network_bw": 1 * GIB,
    }
    return Machine(**{**base, **kw})


def test_staging_replicate_vs_shard():
    ds = flat(8, GIB)  # 8 files of 1 GiB
    rep = stage_time(ds, machine(), "replicate")
    # 4 nodes share 2 GiB/s: 0.5 GiB/s each, 8 GiB -> 16 s; written at 1 GiB/s -> 8 s
    assert (rep.bytes_per_node, rep.read_s, rep.write_s, rep.seconds) == (8 * GIB, 16, 8, 16)
    assert (rep.bound, rep.fits_nvme) == ("PFS", True)
    shard = stage_time(ds, machine(), "shard")
    assert (shard.bytes_per_node, shard.read_s, shard.write_s, shard.bound) == (
        2 * GIB, 4, 2, "PFS",
    )  # fmt: skip
    fast_pfs = stage_time(ds, machine(pfs_read_bw=100 * GIB), "replicate")
    assert (fast_pfs.read_s, fast_pfs.bound) == (8, "NVMe write")  # link 8 s = write 8 s
    slow_disk = stage_time(ds, machine(pfs_read_bw=100 * GIB, nvme_write_bw=2 * GIB), "shard")
    assert (slow_disk.read_s, slow_disk.write_s, slow_disk.bound) == (2, 1, "node link")
    assert not stage_time(ds, machine(nvme_per_node=4 * GIB), "replicate").fits_nvme


def test_shard_share_is_whole_files():
    # (busiest node's bytes on disk, most and least bytes of samples a node holds)
    assert shard_loads(flat(10, MIB), 4) == (3 * MIB, 3 * MIB, 2 * MIB)  # ceil(10/4) files
    assert shard_loads(flat(2, MIB), 4) == (MIB, MIB, 0)  # 2 nodes get nothing
    one_file = stage_time(flat(20, MIB, files=1), machine(), "shard")
    # the one file lands on one node, which alone reads the filesystem (2 GiB/s > its link)
    assert (one_file.bytes_per_node, one_file.read_s) == (20 * MIB, 20 * MIB / GIB)


def test_split_blocks_come_from_the_partition():
    ds, m, job = volume(64), machine(), Job(global_batch=16, step_time=1, halo=(1,))
    s = split_cost(ds, m, job, (2, 1, 1))
    assert (s.blocks, s.data_world, s.local_batch) == (2, 4, 4)
    assert s.rank_sample_bytes == 4 * 6 * 10 * 10 * 4  # (4, 8/2 + 2, 8 + 2, 8 + 2) float32
    assert s.sample_delivered_bytes == 2 * s.rank_sample_bytes
    assert s.overhead == pytest.approx(2 * 9600 / 8192 - 1)
    assert (s.batch_bytes, s.buffer_bytes, s.gpu_bytes) == (4 * 9600, 16 * 9600, 8 * 9600)
    three = machine(nodes=3, ranks_per_node=1)
    uneven = split_cost(ds, three, Job(global_batch=2, step_time=1), (3, 1, 1))
    grid = Grid((8, 8, 8), (3, 1, 1))
    assert [block_shape(grid, k) for k in range(3)] == [(3, 8, 8), (3, 8, 8), (2, 8, 8)]
    assert (uneven.rank_sample_bytes, uneven.sample_delivered_bytes) == (4 * 3 * 8 * 8 * 4, 8192)
    whole = split_cost(ds, m, job, None)
    assert (whole.blocks, whole.local_batch, whole.rank_sample_bytes, whole.overhead) == (
        1, 2, 8192, 0.0,
    )  # fmt: skip


def test_labels_go_whole_to_every_block():
    ds = DatasetSize(
        8,
        (FieldInfo("x", np.float32, (8, 8, 8), (0, 1, 2)), FieldInfo("y", np.float32, (4,))),
    )
    s = split_cost(ds, machine(), Job(global_batch=4, step_time=1), (2, 2, 1))
    assert s.rank_sample_bytes == 4 * 4 * 8 * 4 + 16
    assert s.sample_delivered_bytes == 2048 + 4 * 16


@pytest.mark.parametrize(
    ("parts", "job", "message"),
    [
        ((9, 1, 1), {}, "parts[0]=9 > shape[0]=8"),
        ((2, 1, 1), {"halo": (5,)}, "halo[0]=5 is wider than the smallest"),
        ((3, 1, 1), {}, "3 blocks do not divide the 8 ranks (4 nodes x 2)"),
        ((2, 2, 1), {"global_batch": 3}, "by the 2 data-parallel ranks (8 ranks / 4 blocks)"),
        (None, {"global_batch": 12}, "global batch 12 is not divisible by the 8 ranks"),
        ((2, 1), {}, "has 2 axes, the volume (8, 8, 8) has 3"),
    ],
)
def test_splits_the_loader_would_refuse(parts, job, message):
    j = Job(**{"global_batch": 16, "step_time": 1.0, **job})
    with pytest.raises(PlanError, match=re.escape(message)):
        split_cost(volume(64), machine(), j, parts)


def test_no_split_of_a_sample_without_spatial_axes():
    with pytest.raises(PlanError, match="no delivered field has spatial axes"):
        split_cost(flat(8, 100), machine(), Job(global_batch=8, step_time=1), (2,))
    assert split_ladder(flat(8, 100), machine()) == [None]


def test_the_ladder_doubles_axes_in_turn_up_to_the_world():
    assert split_ladder(volume(8), machine(nodes=2, ranks_per_node=4)) == [
        None, (2, 1, 1), (2, 2, 1), (2, 2, 2),
    ]  # fmt: skip


def test_exchange_per_shuffle():
    m, job = machine(), Job(global_batch=16, step_time=0.01)
    s = split_cost(flat(64, MIB), m, job, None)
    assert s.local_batch == 2
    assert exchange_cost(m, job, s, "replicate", "global") == (0, 0.0)
    # 2 samples a step, 3/4 of them on other nodes; the node's 2 ranks take 3 MiB a step
    assert exchange_cost(m, job, s, "shard", "global") == (3 * MIB // 2, 3 * MIB / GIB)
    # storage order: each global batch lies on one node, which sends 3/4 of its 16 MiB
    assert exchange_cost(m, job, s, "shard", "none") == (3 * MIB // 2, 12 * MIB / GIB)
    # ...unless a file holds one sample: then it is spread as under "global" (this was 12 MiB)
    link = storage_order_link(flat(64, MIB), m, job, s)
    assert (link, storage_order_link(flat(64, MIB, files=4), m, job, s)) == (3 * MIB, 12 * MIB)
    assert exchange_cost(m, job, s, "shard", "none", storage_link=link) == (
        3 * MIB // 2,
        3 * MIB / GIB,
    )
    assert exchange_cost(m, job, s, "shard", "shard") == (0, 0.0)
    assert exchange_cost(m, job, s, "shard", "window:64") == (0, 0.0)


def test_stage_spreads_each_global_batch_of_one_sample_files_over_the_nodes():
    """The premise of ``per_file``: ``stage --mode shard`` deals 64 equal one-sample files to
    the 4 nodes in turn, so each global batch of 16 in storage order has 4 on every node (2
    ranks at mpiexec -n 2 sent 4,096 bytes each under "none" as under "global")."""
    nodes = np.array(split_by_bytes([MIB] * 64, 4))
    for batch in nodes.reshape(-1, 16):
        assert np.bincount(batch, minlength=4).tolist() == [4, 4, 4, 4]


def test_none_over_files_of_fewer_samples_than_a_global_batch_as_a_real_run():
    """30 HDF5 shards of 2 samples (32,788 B each) on 2 nodes of 1 rank, a global batch of 8:
    each batch spans 4 files, dealt to the nodes in turn, so each node holds half of it and
    sends 2 samples a step (a real ``stage --mode shard`` and 2 embedded loaders: 65,576 B a
    step each). Taken as one node's, the plan gave 131,152 B."""
    fields = (FieldInfo("x", np.float32, (8192,)), FieldInfo("y", np.int32, (5,)))
    ds = DatasetSize(60, fields, files=30, file_sizes=((65_600, 2),) * 30)
    m = machine(nodes=2, ranks_per_node=1, gpus_per_node=0)
    job = Job(global_batch=8, step_time=1)
    rows = {(r.staging, r.shuffle): r for r in layouts(ds, m, job, split_cost(ds, m, job, None))}
    none = rows["shard", "none"]
    assert (none.exchange_bytes, none.exchange_s * m.exchange_rate) == (65_576, 65_576)


@settings(max_examples=100, deadline=None)
@given(
    nodes=st.integers(1, 4),
    rpn=st.sampled_from([1, 2, 4]),
    blocks=st.sampled_from([1, 2, 4, 8]),
    per_batch=st.integers(1, 3),
    files=st.lists(st.integers(1, 9), min_size=1, max_size=24),
)
def test_storage_order_link_matches_the_real_order(nodes, rpn, blocks, per_batch, files):
    """Against the loader's own order (``Schedule(shuffle="none")``, ``rank_layout``) with
    each sample on the node the stage puts its file (``split_by_bytes``): the busiest link's
    samples a step, every step counted."""
    world = nodes * rpn
    if world % blocks:
        return
    g = world // blocks * per_batch
    samples = sum(files)
    if samples < g:
        return
    ds = DatasetSize(samples, (FieldInfo("b", np.uint8, (1,)),), files=len(files),
                     file_sizes=tuple((7 * n + 1, n) for n in files))  # fmt: skip
    m = machine(nodes=nodes, ranks_per_node=rpn)
    split = Split(None, blocks, world // blocks, per_batch, 1, blocks, 0.0, 0, 0, 0, True)
    owner = np.repeat(split_by_bytes([b for b, _ in ds.file_sizes], nodes), files)
    sched = Schedule(samples, g, shuffle="none")
    busiest = []
    for step in range(sched.steps_per_epoch):
        link_in, link_out = np.zeros(nodes), np.zeros(nodes)
        for rank in range(world):
            lay = rank_layout(rank, world, blocks)
            for sample in sched.rank_samples(0, step, lay.data_rank, lay.data_world):
                if owner[sample] != rank // rpn:
                    link_in[rank // rpn] += 1
                    link_out[owner[sample]] += 1
        busiest.append(max(link_in.max(), link_out.max()))
    got = storage_order_link(ds, m, Job(global_batch=g, step_time=1), split, most=10**6)
    assert got == pytest.approx(np.mean(busiest))


def test_the_stores_own_exchange_rate_bounds_the_link():
    job = Job(global_batch=16, step_time=0.01)
    s = split_cost(flat(64, MIB), machine(), job, None)
    slow = machine(exchange_bw=GIB / 4)  # the store moves a quarter of what the link could
    assert slow.exchange_rate == GIB / 4
    assert exchange_cost(slow, job, s, "shard", "global") == (3 * MIB // 2, 12 * MIB / GIB)
    fast = machine(exchange_bw=8 * GIB)  # never faster than the link
    assert exchange_cost(fast, job, s, "shard", "global") == (3 * MIB // 2, 3 * MIB / GIB)
    assert machine().exchange_rate == machine().network_bw  # default: the link


def test_layouts_memory_and_sources():
    ds, m, job = flat(64, MIB), machine(), Job(global_batch=16, step_time=0.01)
    rows = {(r.staging, r.shuffle): r for r in layouts(ds, m, job, split_cost(ds, m, job, None))}
    assert list(rows) == [
        ("replicate", "global"), ("replicate", "none"), ("shard", "global"), ("shard", "none"),
        ("shard", "shard"), ("shard", "window:4096"),
    ]  # fmt: skip
    rep, shard, home = rows["replicate", "global"], rows["shard", "global"], rows["shard", "shard"]
    assert (rep.source, rep.resident_bytes, rep.buffer_bytes) == (
        "serve",
        64 * MIB,
        2 * 6 * 2 * MIB,
    )
    assert (shard.source, shard.resident_bytes) == ("serve", 16 * MIB)
    assert (home.source, home.resident_bytes, home.buffer_bytes) == ("embedded", 16 * MIB, 16 * MIB)
    assert shard.exchange_share == pytest.approx(3 * MIB / GIB / 0.01)
    assert home.draws_from == "its home: 1/8 of the dataset"
    sharded_files = flat(64, MIB, files=4)  # the service shards one-sample files only
    rows = layouts(sharded_files, m, job, split_cost(sharded_files, m, job, None))
    assert [r.source for r in rows] == ["serve", "serve"] + ["embedded"] * 4


def test_offnode_home_share_small_cases():
    assert offnode_home_share(4, machine(ranks_per_node=4)) == 0.0
    assert offnode_home_share(8, machine(ranks_per_node=4)) == 0.5
    # world 12, groups of 3 on nodes of 4 ranks: [0-2] home, [3-5] 1+2, [6-8] 2+1, [9-11] home
    assert offnode_home_share(3, machine(nodes=3, ranks_per_node=4)) == pytest.approx(2 / 9)


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(1, 12))
def test_offnode_home_share_counts_rank_by_rank(nodes, rpn, blocks):
    world = nodes * rpn
    if world % blocks:
        return
    m = machine(nodes=nodes, ranks_per_node=rpn)
    node = np.arange(world) // rpn
    group = np.arange(world) // blocks
    # every rank of a data rank holds an equal part of its home
    away = [np.mean(node[group == group[r]] != node[r]) for r in range(world)]
    assert offnode_home_share(blocks, m) == pytest.approx(np.mean(away))


def test_global_exchange_share_matches_the_real_order():
    """The model's (N-1)/N against what a rank really fetches from other nodes over epochs of
    the real order (samples staged in contiguous node shares)."""
    nodes, rpn, samples, batch = 4, 2, 4096, 64
    sched = Schedule(samples, batch, seed=3)
    owner_node = np.arange(samples) * nodes // samples
    world = nodes * rpn
    remote = [
        np.mean(owner_node[sched.rank_epoch(e, r, world)] != r // rpn)
        for e in range(2)
        for r in range(world)
    ]
    assert abs(np.mean(remote) - (nodes - 1) / nodes) < 0.01


def recommend_for(ds: DatasetSize, **kw):
    job_kw = {k: kw.pop(k) for k in ("global_batch", "step_time") if k in kw}
    job = Job(**{"global_batch": 16, "step_time": 10.0, **job_kw})
    plan = make_plan(ds, machine(**kw), job)
    r = plan.recommended
    return None if r is None else (r.staging, r.shuffle, r.source), plan.reasons


def test_recommendations_in_order_of_preference():
    ds = flat(1024, 64 * MIB)  # 64 GiB
    assert recommend_for(ds, memory_per_node=128 * GIB)[0] == ("replicate", "global", "serve")
    got, why = recommend_for(ds, memory_per_node=32 * GIB)
    assert got == ("shard", "global", "serve")
    assert why[0] == "replicate does not fit in memory (65.5 GiB a node)"  # 64 GiB + rings
    assert why[1] == (
        "shard: a node holds 16.0 GiB; the global shuffle moves 96.0 MiB a rank a step between "
        "nodes, 1.9% of a step (limit 10.0%)"
    )
    # a rank takes 2 x 64 MiB a step, 3/4 from other nodes: 192 MiB a node, 0.1875 s at 1 GiB/s
    got, why = recommend_for(ds, memory_per_node=32 * GIB, step_time=0.125)
    assert got == ("shard", "shard", "embedded")
    assert "the global shuffle's exchange would take 150.0% of a step" in why[1]
    got, why = recommend_for(ds, memory_per_node=8 * GIB)
    assert got == ("shard", "window:4096", "embedded")
    got, why = recommend_for(ds, nvme_per_node=8 * GIB)
    assert got is None
    assert why[:2] == (
        "replicate does not fit on NVMe (64.0 GiB a node)",
        "nor does a shard (16.0 GiB on the busiest node): add nodes, or read from the "
        "parallel filesystem",
    )


def test_fewer_files_than_nodes_cannot_be_sharded():
    # one HDF5 file of 64 GiB on 4 nodes: --mode shard puts it on one node, 3 get nothing
    ds = flat(1024, 64 * MIB, files=1)
    got, why = recommend_for(ds, memory_per_node=32 * GIB)
    assert got is None  # it recommended shuffle='window:4096', which the loader refuses
    assert why[1] == (
        "nor can it be sharded: it has fewer files than nodes, so 3 node(s) would hold none of "
        "it (the loader refuses a node without the dataset): store it in at least as many "
        "files as nodes, or use fewer nodes; or stage it replicated and hold it once over the "
        "ranks with the embedded loader's exchange (each rank a contiguous 1/ranks of the "
        "samples)"
    )
    assert stage_time(ds, machine(), "shard").empty_nodes == 3
    assert stage_time(ds, machine(), "replicate").empty_nodes == 0
    assert recommend_for(flat(1024, 64 * MIB, files=4), memory_per_node=32 * GIB)[0] == (
        "shard", "global", "embedded",
    )  # fmt: skip


def test_global_by_the_embedded_loader_where_only_the_rings_overflow():
    # a node's 16 GiB share + the service's rings (2 ranks x 6 batches of 128 MiB) is 17.5 GiB;
    # with the loader's own 2 x 4 batches, 17 GiB: the global shuffle fits, embedded
    got, why = recommend_for(flat(1024, 64 * MIB), memory_per_node=17 * GIB)
    assert got == ("shard", "global", "embedded")  # was ("shard", "shard"): 1/8 of the data
    assert why[1] == (
        "shard: a node holds 16.0 GiB; the global shuffle moves 96.0 MiB a rank a step between "
        "nodes, 1.9% of a step (limit 10.0%); by the embedded loader's exchange (with the "
        "service's rings a node would need 17.5 GiB)"
    )


def test_shard_is_not_recommended_where_it_moves_as_much_as_global():
    # 4 blocks on nodes of 2 ranks: a data rank's blocks span both nodes, so shuffle="shard"
    # moves 16 KiB a rank a step, as "global" does (it was recommended for a cost it has too)
    ds, m = volume(64), machine(nodes=2, memory_per_node=800 * 1024)
    plan = make_plan(ds, m, Job(global_batch=16, step_time=1e-4, spatial=((2, 2, 1),)))
    rows = {(r.staging, r.shuffle): r for r in plan.layouts}
    assert rows["shard", "shard"].exchange_bytes == rows["shard", "global"].exchange_bytes == 16384
    r = plan.recommended
    assert (r.staging, r.shuffle, r.source) == ("shard", "global", "serve")
    assert plan.reasons[1] == (
        "shard: a node holds 256.0 KiB; the global shuffle moves 16.0 KiB a rank a step between "
        "nodes, 30.5% of a step (limit 10.0%), but shuffle='shard' would move as much (a data "
        "rank's spatial blocks span nodes): more ranks per node, or fewer blocks, move less"
    )


def test_plan_picks_the_fewest_blocks_that_work():
    ds, m = volume(64), machine()  # 8 ranks
    plan = make_plan(ds, m, Job(global_batch=4, step_time=1))  # 4 < 8 ranks: split 2 ways
    assert [s.parts for s in plan.splits] == [(2, 1, 1), (2, 2, 1), (2, 2, 2)]
    assert plan.split.parts == (2, 1, 1)
    assert plan.reasons[-1].startswith(
        "spatial parts (2, 1, 1): 2 block(s), 4 data ranks of 1 sample(s) a step (the fewest "
        "blocks that work); 8.0 KiB a rank on its GPU of 16.0 GiB"
    )


def test_no_split_makes_room_on_the_gpu():
    ds = volume(64, shape=(4, 64, 64, 64))  # 4 MiB a sample
    m = machine(gpu_memory=20 * MIB, nodes=1, ranks_per_node=8, gpus_per_node=8)
    fits = make_plan(ds, m, Job(global_batch=8, step_time=1, activation_factor=2.0))
    assert fits.split.parts is None  # 1 sample a rank: (2 prefetch + 2) x 4 MiB = 16 MiB
    assert fits.split.gpu_bytes == 16 * MIB
    big = make_plan(ds, m, Job(global_batch=8, step_time=1, activation_factor=4.0))
    assert [s.gpu_bytes for s in big.splits] == [24 * MIB] * 4  # the same whatever the split
    assert big.split.parts is None
    assert "DOES NOT FIT, and no split makes room" in big.reasons[-1]


def test_configs_refuse_bad_values():
    with pytest.raises(PlanError, match="samples must be a whole number >= 1"):
        volume(0)
    with pytest.raises(PlanError, match="nodes must be a whole number >= 1, got -1"):
        machine(nodes=-1)
    with pytest.raises(PlanError, match="memory_per_node must be a whole number >= 1"):
        machine(memory_per_node=-5)
    with pytest.raises(PlanError, match="memory_per_node must be a whole number >= 1, got 0"):
        machine(memory_per_node=0)  # (serve's --memory-budget refuses 0)
    with pytest.raises(PlanError, match="network_bw must be a finite number > 0"):
        machine(network_bw=math.inf)
    with pytest.raises(PlanError, match="exchange_bw must be a finite number > 0"):
        machine(exchange_bw=0)
    with pytest.raises(PlanError, match="step_time must be a finite number > 0, got 0"):
        Job(global_batch=1, step_time=0)
    with pytest.raises(PlanError, match="boundary must be one of"):
        Job(global_batch=1, step_time=1, boundary="wrap")
    with pytest.raises(PlanError, match=r"halo \(1, 1\) needs one width, or one per spatial"):
        make_plan(volume(8), machine(), Job(global_batch=8, step_time=1, halo=(1, 1)))


def test_shards_of_different_sizes_land_where_the_stage_puts_them():
    """HDF5 shards of 30, 2, 2 and 2 samples on 2 nodes: the stage puts the 30 on one node and
    the rest on the other (a real ``--mode shard`` run and its loaders: 30 and 6 samples held,
    the small node's rank receiving 47,360 B a step where the plan said 32,788). Taken as
    ``ceil(F/N)`` of ``F`` equal files, the plan gave each node 18 samples: staged, held and
    exchanged figures 40% and more off, and a node's memory found to fit where it did not."""
    sizes = ((30 * MIB + 7, 30), (2 * MIB + 7, 2), (2 * MIB + 7, 2), (2 * MIB + 7, 2))
    ds = DatasetSize(36, (FieldInfo("b", np.uint8, (MIB,)),), files=4, file_sizes=sizes)
    assert split_by_bytes([b for b, _ in sizes], 2) == [0, 1, 1, 1]  # what the stage does
    assert shard_loads(ds, 2) == (30 * MIB + 7, 30 * MIB, 6 * MIB)
    m = machine(nodes=2, ranks_per_node=1, memory_per_node=20 * GIB // 1024)
    assert stage_time(ds, m, "shard").bytes_per_node == 30 * MIB + 7
    job = Job(global_batch=4, step_time=1)
    rows = {(r.staging, r.shuffle): r for r in layouts(ds, m, job, split_cost(ds, m, job, None))}
    held = rows["shard", "shard"]
    assert (held.resident_bytes, held.fits_memory) == (30 * MIB, False)  # 20 MiB a node
    # a rank of the node holding 6 of 36 draws 30/36 of its 2 samples a step from the other
    got = rows["shard", "global"]
    assert (got.exchange_bytes, got.exchange_s) == (
        round(2 * MIB * 30 / 36), 2 * MIB * 30 / 36 / m.exchange_rate,
    )  # fmt: skip
    # equal files of unknown sizes: as before
    even = flat(36, MIB, files=4)
    assert shard_loads(even, 2) == (18 * MIB, 18 * MIB, 18 * MIB)
    with pytest.raises(PlanError, match="file sizes of 4 files holding 36 samples, for a "):
        DatasetSize(40, ds.fields, files=4, file_sizes=sizes)

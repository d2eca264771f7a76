"""Under torchrun (no MPI) the ranks hold the dataset once and exchange over torch.distributed
(gloo): the same batches as one process cuts them, blocks and halos included. Through the loader
(``dist_jobs/torch_loader_job.py``) and ``TorchExchange`` alone (``torch_exchange_job.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from datastore.maths.order import Schedule
from datastore.maths.ownership import contiguous_owners
from datastore.maths.partition import Grid, extract_block
from staging.cluster import LAUNCH_ENV

pytestmark = pytest.mark.slow  # torchrun jobs of several processes: not in `make test-quick`

N, C, D = 16, 2, 8
JOB = os.path.join(os.path.dirname(__file__), "dist_jobs", "torch_loader_job.py")
EXCHANGE_JOB = os.path.join(os.path.dirname(__file__), "dist_jobs", "torch_exchange_job.py")
SUB_JOB = os.path.join(os.path.dirname(__file__), "dist_jobs", "sub_job_loader_job.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    path = tmp_path_factory.mktemp("tx") / "d.h5"
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((N, C, D, D, D), dtype=np.float32)
        f["idx"] = np.arange(N, dtype=np.int64)
    with h5py.File(path, "r") as f:
        return str(path), f["x"][...]


def run(world: int, args: list[str], out, timeout: float = 90, job: str = JOB) -> list[dict]:
    """``world`` ranks of ``job`` as torchrun starts them; the results each rank saved in
    ``OUT.rank.npz`` or ``.json`` (rank 1 of a loader timeout test saves none)."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    procs = []
    for rank in range(world):
        env = {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        cmd = [sys.executable, job, *args]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:  # a hang fails this test, not the suite
            if p.poll() is None:
                p.kill()
                p.wait()
    got = []
    for r in range(world):
        if os.path.exists(f"{out}.{r}.json"):
            with open(f"{out}.{r}.json") as f:
                got.append(json.load(f))
        else:
            got.append(dict(np.load(f"{out}.{r}.npz")) if os.path.exists(f"{out}.{r}.npz") else {})
    return got


@pytest.mark.parametrize(
    ("world", "parts"), [(2, "-"), (4, "2,1,1")], ids=["2-data", "2-data-x-2-spatial"]
)
def test_torchrun_ranks_exchange_and_get_the_batches_one_process_cuts(h5, tmp_path, world, parts):
    path, x = h5
    out = tmp_path / "r"
    got = run(world, [path, str(out), "4", "2", parts, "1"], out)
    blocks = 1 if parts == "-" else 2
    data_world = world // blocks
    grid = Grid((D, D, D), (2, 1, 1), (1, 1, 1)) if blocks > 1 else None
    sched = Schedule(N, 4, seed=5)
    owned = np.bincount(contiguous_owners(N, world), minlength=world)
    for rank, r in enumerate(got):
        assert str(r["source"]) == "torch.distributed" and int(r["exchanged"]) > 0
        assert int(r["keys"]) == owned[rank]  # the dataset is held once between the ranks
        d, k = divmod(rank, blocks)
        steps = [sched.order(e).reshape(-1, 4) for e in range(2)]
        want_ids = np.concatenate(steps)[:, d * 4 // data_world : (d + 1) * 4 // data_world]
        assert np.array_equal(r["idx"], want_ids)
        for step, ids in enumerate(want_ids):
            for pos, i in enumerate(ids):
                want = x[i] if grid is None else extract_block(x[i], grid, k, (1, 2, 3))
                assert np.array_equal(r["x"][step][pos], want)


def test_a_pathlib_path_exchanges_as_its_string_does(h5, tmp_path):
    """``DataLoader`` users pass ``pathlib.Path`` datasets; one rank read them, but with an
    exchange every rank raised ``AttributeError: 'PosixPath' object has no attribute 'paths'``
    (the check for a staged share took any non-string for a ``DatasetSpec``)."""
    path, x = h5
    out = tmp_path / "p"
    got = run(2, [f"pathlib:{path}", str(out), "4", "1", "-", "1"], out)
    want = Schedule(N, 4, seed=5).order(0).reshape(-1, 4)
    for rank, r in enumerate(got):
        assert str(r["source"]) == "torch.distributed", r
        assert np.array_equal(r["idx"], want[:, rank * 2 : rank * 2 + 2])
        assert np.array_equal(r["x"], x[r["idx"]])


def test_data_ranks_of_a_model_parallel_job_get_their_batches(h5, tmp_path):
    """4 ranks, 2-way model parallel: ranks 2k and 2k+1 are data rank k of 2, as a
    ``DistributedSampler(num_replicas=2, rank=k)`` is told. ``rank=k, world=2`` made the
    exchange span the default group of 4 (a ``KeyError`` on one rank, ``PeerFailed`` on the
    others); ``ExchangeOptions(group=<the data-parallel group>)`` numbered the ranks by the
    default group (``ValueError: Group rank 2 is not part of group``). Now: a job of its own
    (each rank reads its share, a warning saying so), an exchange within the group; ranks
    numbered otherwise than the group numbers them are refused, naming both. A second loader
    over the group, made once the first was closed, hung in ``new_group`` (torch named its gloo
    group as the destroyed one's, whose keys were still in the store)."""
    path, _ = h5
    out = tmp_path / "s"
    got = run(4, [path, str(out)], out, 120, SUB_JOB)
    want = Schedule(N, 4, seed=3).order(0).reshape(-1, 4)
    for rank, row in enumerate(got):
        mine = want[:, (rank // 2) * 2 : (rank // 2) * 2 + 2].tolist()
        ways = (
            ("given", "local"),
            ("group", "torch.distributed"),
            ("group-again", "torch.distributed"),
        )
        for way, source in ways:
            r = row[way]
            assert "error" not in r, (rank, way, r)
            assert (r["rank"], r["world"], r["ids"]) == (rank // 2, 2, mine), (rank, way, r)
            assert r["source"] == source, (rank, way, r)
        assert "taken as a job of its own" in row["given"]["warnings"][0]
        assert row["group"]["warnings"] == []
        kind, text = row["misnumbered"]["error"]
        assert kind == "ValueError" and text.startswith(
            f"the torch.distributed group numbers this rank {rank} of 4, but the loader is rank "
            f"{(rank + 1) % 4} of 4 (given)"
        ), text


def test_a_rank_that_stops_taking_batches_times_the_others_out(h5, tmp_path):
    path, _ = h5
    out = tmp_path / "t"
    t0 = time.monotonic()
    got = run(2, [path, str(out), "4", "2", "-", "0", "1"], out)
    err = str(got[0]["error"])
    assert err.startswith("ExchangeTimeout") and "step" in err, err
    assert time.monotonic() - t0 < 40


@pytest.mark.parametrize(
    ("world", "parts", "budget"),
    [(2, "-", "0"), (4, "2,1,1", "-")],
    ids=["2-data-samples-re-read", "2-data-x-2-spatial-halo"],
)
def test_the_exchange_fills_reused_buffers_as_one_process_cuts(h5, tmp_path, world, parts, budget):
    """``TorchExchange.step`` over 2 epochs into buffers a consumer scribbled on before every
    step equals ``fill_batch`` of the whole samples, zero halo included. Budget 0: no sample
    has a slot, each is re-read into one scratch array that the next read reuses (a send must
    not share it); the halo case sends and receives blocks that are not contiguous."""
    path, _ = h5
    out = tmp_path / "e"
    got = run(world, ["check", path, str(out), "4", parts, "1", budget, "2"], out, 60, EXCHANGE_JOB)
    owned = np.bincount(contiguous_owners(N, world), minlength=world)
    for rank, r in enumerate(got):
        assert r["bad"] == [], f"rank {rank}: (epoch, step, field) differ: {r['bad']}"
        assert r["steps"] == 2 * (N // 4)
        assert r["keys"] == owned[rank] and r["bytes_sent"] > 0
        if budget == "0":  # every use of an owned sample read it again
            assert r["misses"] > r["keys"]


def test_a_rank_that_skips_a_step_gives_its_peer_an_exchange_timeout_naming_both(h5, tmp_path):
    path, _ = h5
    out = tmp_path / "s"
    timeout = 2.0
    got = run(2, ["skip", path, str(out), "4", str(timeout), "1"], out, 60, EXCHANGE_JOB)
    assert got[1] == {"skipped": 1}
    r = got[0]
    # The first step from 1 on that needs rank 1 (the order decides which; the job says).
    assert r.get("step") == r["expected_step"] and r["peers"] == [1], r
    assert f"at step {r['step']}" in r["error"] and "waiting for rank 1" in r["error"]
    assert timeout <= r["waited"] < 2 * timeout
    assert r["again"] == (
        f"the torch.distributed exchange failed at step {r['step']} and cannot be used again "
        "(messages of that step may still arrive): make a new loader"
    )


def forked(world: int, mode: str, args: list[str], timeout: float = 30) -> list[dict]:
    """``mode`` of ``torch_exchange_job.py`` on ``world`` ranks forked from this process (torch
    imported once, not per rank: each rank of ``run`` spends seconds importing it)."""
    import importlib.util
    import multiprocessing

    spec = importlib.util.spec_from_file_location("torch_exchange_job", EXCHANGE_JOB)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    ctx = multiprocessing.get_context("fork")
    results = ctx.SimpleQueue()  # a put is written at once: the rank ends with os._exit
    port = free_port()

    def rank_main(rank: int) -> None:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        results.put((rank, getattr(job, mode)(*args)))
        os._exit(0)

    procs = [ctx.Process(target=rank_main, args=(r,)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:  # a hang fails this test, not the suite
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    got = dict(results.get() for _ in range(world) if not results.empty())
    assert sorted(got) == list(range(world)), f"ranks that ended within {timeout} s: {got}"
    return [got[r] for r in range(world)]


def test_a_rank_whose_step_fails_tells_its_waiting_peer_why_at_once(h5, tmp_path):
    """Rank 1 cannot read a sample rank 0 waits for and lives on. Rank 0 waited out the whole
    timeout (20.3 s of 20 in a torchrun job) and got ``ExchangeTimeout``, the cause unnamed;
    now ``PeerFailed`` with rank 1's error at once, as over MPI."""
    path, _ = h5
    got = forked(2, "fail", [path, str(tmp_path / "f"), "4", "10", "1"])
    step = got[1]["step"]
    assert got[1]["error"].startswith("OSError: sample ") and got[0]["step"] == step, got
    why = got[1]["error"]
    assert got[0]["error"] == (
        f"PeerFailed: rank 1 failed ({why}) at step {step} of the torch.distributed exchange, "
        "whose messages this rank waited for"
    )
    assert got[0]["waited"] < 1.0, got[0]


def test_two_loaders_side_by_side_and_the_trainings_all_reduces_never_mix(h5, tmp_path):
    """A training and a validation loader iterated together (both prefetch threads exchange at
    once) and CPU DDP's all-reduces on the default gloo group: each loader has a gloo group of
    its own (freed by ``close``), so no rank takes another loader's messages (on one shared
    group a step's messages matched the other loader's: garbage positions, RankMismatch)."""
    path, _ = h5
    out = tmp_path / "d"
    job = os.path.join(os.path.dirname(__file__), "dist_jobs", "torch_train_job.py")
    got = run(2, [path, str(out), "3"], out, 60, job)
    for r in got:
        assert r["error"] is None, r["error"]
        assert r["source"] == "torch.distributed" and r["batches"] == 2 * 3 * (N // 4)
        assert r["wrong_bytes"] == 0 and r["wrong_sums"] == 0
        assert r["own_groups"] and r["destroyed"]

"""Under torchrun (no MPI) the ranks hold the dataset once and exchange over torch.distributed
(gloo): the same batches as one process cuts them, blocks and halos included."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from datastore.order import Schedule, contiguous_owners
from datastore.partition import Grid, extract_block
from staging.cluster import LAUNCH_ENV

N, C, D = 16, 2, 8
JOB = os.path.join(os.path.dirname(__file__), "dist_jobs", "torch_loader_job.py")


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


def run(world: int, args: list[str], out, timeout: float = 90) -> list[dict]:
    """``world`` ranks as torchrun starts them; the results each rank saved (rank 1 of a
    timeout test saves none)."""
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
        cmd = [sys.executable, JOB, *args]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
    saved = [f"{out}.{r}.npz" for r in range(world)]
    return [dict(np.load(f)) if os.path.exists(f) else {} for f in saved]


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


def test_a_rank_that_stops_taking_batches_times_the_others_out(h5, tmp_path):
    path, _ = h5
    out = tmp_path / "t"
    t0 = time.monotonic()
    got = run(2, [path, str(out), "4", "2", "-", "0", "1"], out)
    err = str(got[0]["error"])
    assert err.startswith("ExchangeTimeout") and "step" in err, err
    assert time.monotonic() - t0 < 40

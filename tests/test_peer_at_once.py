"""The MPI link answers a fetch of samples in RAM on its own thread, the other requests on its
pool, with the same bytes and errors (real ``mpiexec`` ranks); and what says a fetch can be
answered at once: a resident dataset by the name clients give it, its samples in RAM."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from helpers import mpi_job, run_job

from datastore.service.errors import ServiceError
from datastore.service.resident import Residency

JOB = Path(__file__).parent / "mpi_jobs" / "peer_at_once_job.py"


@pytest.mark.mpi
def test_fetches_in_ram_are_answered_by_the_link_while_the_pool_is_busy(tmp_path):
    out = tmp_path / "got.json"
    got = run_job(mpi_job(2, JOB, out), out, timeout=120)
    assert got["described"] == ["busy"]  # answered once a fetch was, while it waited
    assert got["resident"] is True and got["on_disk"] is True  # exact bytes either way
    assert got["refused"] == ["OUT_OF_RANGE", "node 0: sample 1 is refused"]
    threads = got["threads"]
    assert threads["fetch [0]"] == "datastore-peers", threads  # the link's thread
    assert threads["fetch [2, 0]"].startswith("datastore-peer_"), threads  # the pool
    assert threads["describe"].startswith("datastore-peer_"), threads
    assert got["thread_multiple"] is True  # the askers send their requests themselves
    assert got["closed"] == ["UNAVAILABLE", "node 0 was not asked: this service is stopping"]


def test_a_fetch_is_answered_at_once_only_where_every_sample_is_in_ram(tmp_path):
    data = np.random.default_rng(0).standard_normal((8, 2, 4, 4), np.float32)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = data
    # 4 samples of 8 in RAM: a dataset that does not fit leaves an eighth to the rings
    residency = Residency(budget=5 * data[0].nbytes, threads=1)
    try:
        r = residency.load(str(path), "t{node}.h5")
        assert r.wait(10)
        assert residency.acquire_named(str(path)) is None  # by the name clients give only
        held = residency.acquire_named("t{node}.h5")
        assert held is r and r.sessions == 1
        residency.release(held)
        assert r.sessions == 0
        in_ram = [i for i in range(8) if r.store.in_ram(i, "x")]
        assert len(in_ram) == 4
        elsewhere = next(i for i in range(8) if i not in in_ram)
        asked = (["x"], None, 0)
        pieces = r.pieces_in_ram(in_ram[:2], *asked)
        assert pieces is not None
        got = np.concatenate([p.view(np.float32) for p in pieces.runs()])
        assert np.array_equal(got, data[in_ram[:2]].reshape(-1))
        assert r.pieces_in_ram([in_ram[0], elsewhere], *asked) is None  # the pool reads it
        runs = r.pieces([elsewhere], *asked).runs()
        assert np.array_equal(np.concatenate(runs).view(np.float32), data[elsewhere].reshape(-1))
    finally:
        residency.close()


def test_each_block_and_layout_a_peer_asks_for_is_answered_with_its_own_part(tmp_path):
    """The delivered fields of a peer's fetch are kept per (fields, layout, block): blocks
    asked in turn each get their own part, and a refused block is refused every time."""
    data = np.arange(8 * 2 * 4 * 4, dtype=np.float32).reshape(8, 2, 4, 4)
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = data
    residency = Residency(budget=None, threads=1)
    try:
        r = residency.load(str(path), "t")
        assert r.wait(10)
        halves = {"parts": [2, 1, 1], "halo": 0}
        for spatial, block, want in [
            (halves, 0, data[1, :1]),
            (halves, 1, data[1, 1:]),
            (halves, 0, data[1, :1]),
            (None, 0, data[1]),
            ({"parts": [1, 2, 1], "halo": 0}, 1, data[1, :, 2:]),
        ]:
            pieces = r.pieces_in_ram([1], ["x"], spatial, block)
            got = np.concatenate(pieces.runs()).view(np.float32)
            assert np.array_equal(got, want.reshape(-1)), (spatial, block)
        for _ in range(2):
            with pytest.raises(ServiceError, match=r"block 2 is outside 0\.\.1"):
                r.pieces_in_ram([1], ["x"], halves, 2)
    finally:
        residency.close()


def test_a_dataset_a_peer_is_being_answered_from_is_not_evicted_under_it(tmp_path):
    """While a peer's fetch is answered (the dataset held, as ``answer`` and ``answer_at_once``
    hold it), making room for another dataset leaves it resident; once released, it is the
    one evicted."""
    data = np.arange(8 * 32, dtype=np.float32).reshape(8, 32)
    paths = []
    for k in range(3):
        paths.append(tmp_path / f"d{k}.h5")
        with h5py.File(paths[-1], "w") as f:
            f["x"] = data + k
    residency = Residency(budget=data.nbytes + data[:4].nbytes, threads=1)  # 1.5 datasets
    try:
        first = residency.load(str(paths[0]), "first")
        assert first.wait(10)
        held = residency.acquire_named("first")
        residency.load(str(paths[1])).wait(10)  # wants all the room: first is held
        assert first in residency.all(), "a dataset being answered from was evicted"
        residency.release(held)
        residency.load(str(paths[2])).wait(10)
        assert first not in residency.all()  # released: least recently used, evicted
    finally:
        residency.close()

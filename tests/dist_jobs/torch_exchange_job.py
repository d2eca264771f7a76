"""One rank of a torchrun-style job (no MPI) driving ``TorchExchange`` directly, without the
loader: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment.

Each rank stores only its contiguous share of an HDF5 dataset (fields ``x`` (N, C, D, D, D)
and ``idx``), runs ``step`` over every step of the epochs into the same ``out`` buffers
(overwritten with a sentinel before each step: a step must write the whole box, zero halo
included) and compares them with one process's cut of the whole samples (``fill_batch``).
It writes ``OUT.rank.json``.

Usage:
  torch_exchange_job.py check DATASET OUT GLOBAL_BATCH PARTS HALO BUDGET EPOCHS
    PARTS, HALO: e.g. ``2,1,1`` and ``1``, or ``-`` for whole samples; BUDGET: the store's
    RAM budget in bytes (``0``: no slot in RAM, every sample re-read into one scratch array),
    or ``-`` for all in RAM.
  torch_exchange_job.py skip DATASET OUT GLOBAL_BATCH TIMEOUT SKIP
    rank 1 never calls step SKIP (it sleeps instead); the others must raise ExchangeTimeout,
    then refuse the next step (the exchange takes no step after a failed one).
  torch_exchange_job.py fail DATASET OUT GLOBAL_BATCH TIMEOUT AT
    rank 1 cannot read its samples from the first step from AT on that rank 0 needs one of
    them (an OSError), and lives on past rank 0's wait; rank 0 must hear why at once.
"""

from __future__ import annotations

import json
import sys
import time

import h5py
import numpy as np
import torch.distributed as dist

from datastore.errors import DataStoreError, ExchangeTimeout
from datastore.maths.delivery import delivered_fields
from datastore.maths.order import Schedule
from datastore.maths.ownership import RangeOwners
from datastore.maths.partition import Grid
from datastore.readers.base import FieldInfo
from datastore.sources.owners import ExchangeSetup
from datastore.sources.torch_dist import TorchExchange, gloo_group
from datastore.store.gather import Gather, fill_batch
from datastore.store.store import SlotSpec, Store

SENTINEL = 7.0


def setup(
    path: str, gb: int, parts: str, halo: str, budget: int | None, timeout: float, broken=None
):
    """This rank's exchange, its delivered fields, the schedule and the whole dataset (the
    reference only); a read raises ``OSError`` while ``broken`` (a set) is not empty."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with h5py.File(path, "r") as f:
        whole = {name: f[name][...] for name in ("x", "idx")}
    n = len(whole["idx"])
    info = {
        "x": FieldInfo("x", whole["x"].dtype, whole["x"].shape[1:], (1, 2, 3)),
        "idx": FieldInfo("idx", whole["idx"].dtype, ()),
    }
    grid = None
    if parts != "-":
        volume = whole["x"].shape[2:]
        grid = Grid(volume, tuple(int(p) for p in parts.split(",")), (int(halo),) * len(volume))
    blocks = 1 if grid is None else grid.nblocks
    by_block = {k: delivered_fields(info, grid, k) for k in range(blocks)}
    owner = RangeOwners(n, world)
    keys = owner.keys_of(rank)
    h5 = h5py.File(path, "r")

    def read(key: int, name: str, out: np.ndarray) -> None:
        if broken:
            raise OSError(f"sample {key} cannot be read")
        out[...] = h5[name][key]

    specs = {name: SlotSpec(fi.shape, np.dtype(fi.dtype)) for name, fi in info.items()}
    store = Store(keys, specs, read, budget=budget)
    group = gloo_group()
    data_world = world // blocks
    shares = ExchangeSetup(owner, data_world, blocks, store, by_block, Gather(1), timeout)
    ex = TorchExchange(group, shares)
    return ex, by_block[rank % blocks], Schedule(n, gb, seed=5), whole, data_world, blocks


def check(path: str, out: str, gb: str, parts: str, halo: str, budget: str, epochs: str) -> dict:
    limit = None if budget == "-" else int(budget)
    ex, mine, sched, whole, data_world, blocks = setup(path, int(gb), parts, halo, limit, 10.0)
    rank = dist.get_rank()
    d = rank // blocks
    b = sched.local_batch(data_world)
    bufs = {f.name: np.empty((b, *f.shape), f.dtype) for f in mine}
    want = {f.name: np.empty((b, *f.shape), f.dtype) for f in mine}
    steps, bad = 0, []
    for epoch in range(int(epochs)):
        for step in range(sched.steps_per_epoch):
            batch = sched.global_batch_at(epoch, step)
            for a in bufs.values():
                a.fill(SENTINEL)  # what a consumer's edits or an earlier batch left there
            ex.step(step, ex.messages(batch), bufs)
            ids = batch[d * b : (d + 1) * b]
            fill_batch(ids, mine, lambda i, name: whole[name][i], want)
            for name in bufs:
                if not np.array_equal(bufs[name], want[name]):
                    bad.append([epoch, step, name])
            steps += 1
    result = {
        "steps": steps,
        "bad": bad,
        "keys": len(ex.setup.store.keys),
        "bytes_sent": ex.bytes_sent,
        "misses": ex.setup.store.counters.misses,
    }
    ex.close()
    return result


def skip(path: str, out: str, gb: str, timeout: str, at: str) -> dict:
    ex, mine, sched, _, data_world, _ = setup(path, int(gb), "-", "0", None, float(timeout))
    rank = dist.get_rank()
    b = sched.local_batch(data_world)
    bufs = {f.name: np.empty((b, *f.shape), f.dtype) for f in mine}
    owner = RangeOwners(sched.num_samples, dist.get_world_size())

    def crosses(step: int) -> bool:  # a rank needs a sample the other holds
        return any(
            (owner[sched.rank_samples(0, step, r, data_world)] != r).any()
            for r in range(data_world)
        )

    # The first step from ``at`` on whose exchange needs rank 1: where its peer must notice.
    expected = next(s for s in range(int(at), sched.steps_per_epoch) if crosses(s))
    for step in range(sched.steps_per_epoch):
        if rank == 1 and step == int(at):
            time.sleep(float(timeout) + 1.5)  # stops taking part: its peers must not hang
            return {"skipped": step}
        t0 = time.monotonic()
        try:
            ex.step(step, ex.messages(sched.global_batch_at(0, step)), bufs)
        except ExchangeTimeout as exc:
            waited = time.monotonic() - t0
            try:  # the exchange takes no step after a failed one
                ex.step(step + 1, ex.messages(sched.global_batch_at(0, step + 1)), bufs)
                again = None
            except DataStoreError as refused:
                again = str(refused)
            return {
                "error": str(exc),
                "expected_step": expected,
                "step": exc.step,
                "peers": list(exc.peers),
                "waited": waited,
                "again": again,
            }
    return {"finished": True}


def crossing(sched: Schedule, at: int, data_world: int) -> int:
    """The first step from ``at`` on at which a rank needs a sample another rank holds."""
    owner = RangeOwners(sched.num_samples, dist.get_world_size())
    return next(
        s
        for s in range(at, sched.steps_per_epoch)
        if any(
            (owner[sched.rank_samples(0, s, r, data_world)] != r).any() for r in range(data_world)
        )
    )


def fail(path: str, out: str, gb: str, timeout: str, at: str) -> dict:
    broken: set[int] = set()  # rank 1 reads nothing once it holds a step
    ex, mine, sched, _, data_world, _ = setup(path, int(gb), "-", "0", 0, float(timeout), broken)
    rank = dist.get_rank()
    bufs = {f.name: np.empty((sched.local_batch(data_world), *f.shape), f.dtype) for f in mine}
    expected = crossing(sched, int(at), data_world)
    for step in range(expected + 1):
        if rank == 1 and step == expected:
            broken.add(step)
        t0 = time.monotonic()
        try:
            ex.step(step, ex.messages(sched.global_batch_at(0, step)), bufs)
        except Exception as exc:
            waited = time.monotonic() - t0
            if rank == 1:
                time.sleep(1.5)  # lives on: its peer must not wait for its exit
            return {"error": f"{type(exc).__name__}: {exc}", "step": step, "waited": waited}
    return {"finished": True}


def main() -> None:
    mode, path, out, *args = sys.argv[1:]
    dist.init_process_group("gloo")
    result = {"check": check, "skip": skip, "fail": fail}[mode](path, out, *args)
    with open(f"{out}.{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    if mode == "check":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

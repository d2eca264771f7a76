"""The services' MPI link against bare mpi4py, in the same two processes, on the same fetches.

``benchmarks/peers.py`` runs this after each ``mpi`` job (``mpiexec -n 2 python -m mpi4py
benchmarks/peers_link.py SPEC``). Rank k plays node k of the sharded store: it builds what
``datastore serve`` builds on an MPI node, a :class:`~datastore.service.servicer.Servicer`
with its :class:`~datastore.service.peers.MpiPeers` link and its residency (no gRPC server:
no client is served), and loads its shard of the dataset. Then, alternating, ``reps`` times:

- **bare**: mpi4py replaying node k's fetches as the job recorded them (each fetch's
  messages, of the sizes the services sent), both directions at once, ``depth`` fetches in
  flight each way, from and into ready buffers cycling through up to 256 MiB;
- **typed**: bare mpi4py doing the link's job the MPI way: the same samples' parts sent from
  the owner's resident samples and received into batch slots amid their halos through
  subarray datatypes (a message per sample, field and channel), ``depth`` in flight;
- **link**: node k asking node k's service for the same fetches the way a stream does
  (:meth:`~datastore.service.resident.Resident.start_fetch` into batch slots cycling through
  up to 256 MiB, ``depth`` in flight, each finished with its copies: the parts received
  aside, the zero halo), the other rank's service answering from its resident samples.

Each timed replay follows 2 untimed fetches; all three move the same bytes (checked: the
link's fetches must come in the messages the job recorded, and the typed and link slots must
end up equal). Rank 0 prints ``{"bare": [s, ...], "typed": [...], "link": [...]}``, the
seconds of each replay. Unlike the jobs' own "in flight" rate, the link here runs as deep as
bare does and shares the cores with its peer only: what it measures is the link's code (its
thread hops, requests, copies), not how the ranks pace it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from datastore.maths.delivery import (
    Delivered,
    covered,
    covered_sizes,
    delivered_fields,
    parse_spatial,
    spatial_grid,
)
from datastore.service.config import ServeConfig
from datastore.service.logs import JsonLog
from datastore.service.peers import node_path
from datastore.service.servicer import Counters, Servicer, Stop
from datastore.store.gather import Gather, run_copies

MIB = 1 << 20
POOL = 256 * MIB  # bytes of buffers (bare) or batch slots (link) each rank cycles through


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    comm = MPI.COMM_WORLD
    me = comm.Get_rank()
    fetches, depth = spec["fetches"], spec["depth"]
    servicer, resident = _node(comm, spec)
    try:
        plans = [_plan(resident, node, fetches[node], spec["spatial"]) for node in range(2)]
        slots = {name: plans[me].slots() for name in ("typed", "link")}
        players = {
            "bare": _bare(comm, fetches[me], fetches[1 - me], depth),
            "typed": _typed(comm, resident, plans, slots["typed"], depth),
            "link": _link(resident, plans[me], slots["link"], depth),
        }
        runs: dict[str, list[float]] = {name: [] for name in players}
        for rep in range(spec["reps"]):
            for name in list(players)[:: 1 if rep % 2 == 0 else -1]:
                play = players[name]
                play(2)
                comm.Barrier()
                t0 = time.perf_counter()
                play(None)
                comm.Barrier()
                runs[name].append(time.perf_counter() - t0)
        for a, b in zip(slots["typed"], slots["link"], strict=True):  # the same fetches last
            if any(not np.array_equal(a[f], b[f]) for f in a):
                raise SystemExit(f"node {me}: the link and typed mpi4py filled a slot unlike")
        if me == 0:
            print(json.dumps(runs), flush=True)
    finally:
        comm.Barrier()  # (neither side's link stops while the other still asks)
        servicer.residency.release(resident)
        servicer.close()
    return 0


def _bare(comm: Any, into: list[list[int]], out: list[list[int]], depth: int) -> Any:
    """``play(count)``: ``count`` (``None``: all) of the fetches ``into`` received from the
    other rank while ``out`` are sent to it, ``depth`` in flight each way."""
    other = 1 - comm.Get_rank()
    n = max(len(into), len(out))
    biggest = max(sum(f) for f in into + out)
    k = max(1, min(n, POOL // biggest))  # the bytes do not come from a cache
    rbuf = [np.ones(biggest, np.uint8) for _ in range(k)]  # pages in place
    sbuf = [np.ones(biggest, np.uint8) for _ in range(k)]

    def posts(i: int) -> list[Any]:
        reqs = []
        for sizes, buf, post in ((into, rbuf, comm.Irecv), (out, sbuf, comm.Isend)):
            if i < len(sizes):
                at = 0
                for m in sizes[i]:
                    reqs.append(post(buf[i % k][at : at + m], other, 0))
                    at += m
        return reqs

    return _windowed(n, posts, depth)


def _node(comm: Any, spec: dict[str, Any]) -> tuple[Any, Any]:
    """This rank's service (its link and residency; no gRPC server) and its shard, loaded."""
    me = comm.Get_rank()
    servicer = Servicer(
        config=ServeConfig(socket=Path(spec["tmp"], f"link{me}.sock")),
        listen=[],
        stop=Stop(),
        counters=Counters(),
        log=JsonLog(open(os.devnull, "w")),  # noqa: SIM115 (the process's lifetime)
        comm=comm,
    )
    template = spec["template"]
    resident = servicer.residency.acquire(os.path.realpath(node_path(template, me)), template)
    if resident.owner is None:
        raise SystemExit(f"{template} is not sharded over the two ranks")
    resident.wait()
    for i in resident.store.keys.tolist():  # every sample of this shard in RAM
        for name in resident.reader.fields:
            resident.sample(int(i), name)
    return servicer, resident


@dataclass(frozen=True)
class Plan:
    """What node ``node`` asks the other for: block ``block`` (``fields``) of ``samples[i]``
    in fetch ``i``, as many samples as the job's fetch ``i`` carried."""

    node: int
    spatial: dict[str, Any] | None
    block: int
    fields: list[Delivered]
    samples: list[np.ndarray]

    def slots(self) -> list[dict[str, np.ndarray]]:
        """Batch slots (``{field: (n, *box)}``, zero halo, pages in place) to cycle through."""
        most = max(len(s) for s in self.samples)
        nbytes = most * sum(f.nbytes for f in self.fields)
        return [
            {f.name: np.full((most, *f.shape), 0, f.dtype) for f in self.fields}
            for _ in range(max(1, min(len(self.samples), POOL // nbytes)))
        ]


def _plan(resident: Any, node: int, fetches: list[list[int]], spatial: Any) -> Plan:
    """Node ``node``'s fetches: the samples the other node owns, taken in turn, as many per
    fetch as the job's, whose messages they must match (checked)."""
    spatial = parse_spatial(spatial)
    info = resident.reader.fields
    grid = spatial_grid(info, spatial)
    block = node if grid is not None else 0
    fields = delivered_fields(info, grid, block)
    part = [covered_sizes(f) for f in fields]
    per_sample = sum(sum(p) for p in part)
    owner = np.asarray(resident.owner[np.arange(resident.num_samples)]).reshape(-1)
    theirs = np.flatnonzero(owner != node)
    samples, at = [], 0
    for sizes in fetches:
        n = sum(sizes) // per_sample
        cut = [m for p in part for _ in range(n) for m in p]  # field after field, by sample
        if cut != sizes:
            raise SystemExit(
                f"node {node}: a recorded fetch of {len(sizes)} messages ({sum(sizes)} bytes) "
                f"is not {n} samples' parts of block {block} ({len(cut)} messages)"
            )
        samples.append(theirs[(at + np.arange(n)) % len(theirs)])
        at += n
    return Plan(node, spatial, block, fields, samples)


def _typed(
    comm: Any, resident: Any, plans: list[Plan], slots: list[dict[str, np.ndarray]], depth: int
) -> Any:
    """``play(count)``: bare mpi4py moving each sample's part straight from the owner's
    resident sample into the asker's batch slot, amid its halo, the MPI way: a message per
    sample, field and index of the first axis (a channel), sent from where it lies (a
    subarray datatype where that is not contiguous) and received into its place by a
    subarray datatype."""
    me, other = comm.Get_rank(), 1 - comm.Get_rank()
    mine, theirs = plans[me], plans[other]

    def sub(f: Delivered, shape: tuple[int, ...], box: tuple[slice, ...]) -> tuple[Any, range]:
        """``[count, datatype]`` of ``box``'s part below its first axis, and that axis's
        indices."""
        starts = [s.start for s in box[1:]]
        sizes = [s.stop - s.start for s in box[1:]]
        kind = from_numpy_dtype(f.dtype)
        if sizes == list(shape[1:]):  # contiguous
            return [math.prod(sizes), kind], range(box[0].start, box[0].stop)
        kind = kind.Create_subarray(list(shape[1:]), sizes, starts).Commit()
        return [1, kind], range(box[0].start, box[0].stop)

    into = [sub(f, f.shape, covered(f)[1]) for f in mine.fields]
    out = [sub(f, f.sample_shape or f.shape, covered(f)[0]) for f in theirs.fields]
    n = max(len(mine.samples), len(theirs.samples))

    def posts(i: int) -> list[Any]:
        reqs = []
        if i < len(mine.samples):
            slot = slots[i % len(slots)]
            for f, (kind, lead) in zip(mine.fields, into, strict=True):
                for j in range(len(mine.samples[i])):
                    reqs += [comm.Irecv([slot[f.name][j][c], *kind], other, 0) for c in lead]
        if i < len(theirs.samples):
            for f, (kind, lead) in zip(theirs.fields, out, strict=True):
                for index in theirs.samples[i].tolist():
                    sample = resident.sample(index, f.name)
                    reqs += [comm.Isend([sample[c], *kind], other, 0) for c in lead]
        return reqs

    return _windowed(n, posts, depth)


def _windowed(n: int, start: Any, depth: int, finish: Any = MPI.Request.Waitall) -> Any:
    """``play(count)``: ``start(i)`` for ``i < count`` (``None``: ``n``), ``finish``-ing the
    oldest of what it returned whenever ``depth`` are in flight, then the rest."""

    def play(count: int | None) -> None:
        window: list[Any] = []
        for i in range(n if count is None else min(count, n)):
            window.append(start(i))
            if len(window) >= depth:
                finish(window.pop(0))
        for started in window:
            finish(started)

    return play


def _link(resident: Any, plan: Plan, slots: list[dict[str, np.ndarray]], depth: int) -> Any:
    """``play(count)``: ``count`` (``None``: all) of ``plan``'s fetches through the services'
    code, as a stream makes them, ``depth`` in flight."""
    gather, never = Gather(), threading.Event()

    def start(i: int) -> Any:
        out = slots[i % len(slots)]
        return resident.start_fetch(plan.samples[i], plan.fields, plan.spatial, plan.block, out)

    def finish(fetching: Any) -> None:
        run_copies(fetching.result(never), gather)

    return _windowed(len(plan.samples), start, depth, finish)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

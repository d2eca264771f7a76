"""The services' peer links against bare transfers, in the same two processes, on the same fetches.

``benchmarks/peers.py`` runs this after each ``mpi`` job (``mpiexec -n 2 python -m mpi4py
benchmarks/peers_link.py SPEC``) and each ``grpc`` job (two plain ``python
benchmarks/peers_link.py SPEC NODE`` processes, meeting over a control connection). Process k
plays node k of the sharded store: it builds what ``datastore serve`` builds on that node, a
:class:`~datastore.service.servicer.Servicer` with its peer link and its residency, and loads
its shard of the dataset. Over MPI that is the :class:`~datastore.service.mpi_peers.MpiPeers`
link (no gRPC server: no client is served); over gRPC, the
:class:`~datastore.service.grpc_peers.GrpcPeers` link and what answers it: the TCP server
with the ``Peers`` service (token checked) and the data listener (no Unix socket). Then,
alternating, ``reps`` times:

- **bare**: the job's fetches replayed bare, both directions at once, ``depth`` fetches in
  flight each way, from and into ready buffers cycling through up to 256 MiB. Over MPI,
  mpi4py sends each fetch's messages, of the sizes the services sent, into contiguous
  buffers. Over gRPC, plain blocking TCP sockets, as a user would write them: ``depth``
  connections each way, a thread per connection on the owner answering a 4-byte request with
  the fetch's bytes in one ``sendmsg``, the asker receiving them with ``recv_into``
  (``MSG_WAITALL``).
- **typed** (MPI only): bare mpi4py doing the link's job the MPI way: the same samples'
  parts sent from the owner's resident samples and received into batch slots amid their
  halos through subarray datatypes (a message per sample, field and channel), ``depth`` in
  flight;
- **link**: node k asking node k's service for the same fetches the way a stream does
  (:meth:`~datastore.service.resident.Resident.start_fetch` into batch slots cycling through
  up to 256 MiB, ``depth`` in flight, each finished with its copies: the parts received
  aside, the zero halo), the other process's service answering from its resident samples.

Each timed replay follows 2 untimed fetches; all move the same bytes (checked: the link's
fetches must come as the job's did: over MPI in its messages, over gRPC in its bytes per
fetch; and over MPI the typed and link slots must end up equal). Process 0 prints ``{"bare":
[s, ...], "typed": [...], "link": [...]}``, the seconds of each replay. Unlike the jobs' own
"in flight" rate, the link here runs as deep as bare does and shares the cores with its
peer only: what it measures is the link's code (its thread hops, requests, copies), not how
the ranks pace it. The processes meet between replays by a blocking barrier (over MPI,
``Barrier``; over gRPC, a byte each way on the control connection, which spins no core).
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import SimpleQueue
from typing import Any

import numpy as np

from datastore.maths.delivery import (
    Delivered,
    batch_pad_copies,
    covered,
    covered_sizes,
    delivered_fields,
    parse_spatial,
    spatial_grid,
)
from datastore.service.config import ServeConfig
from datastore.service.logs import JsonLog
from datastore.service.peer_link import node_path
from datastore.service.servicer import Counters, Servicer, Stop
from datastore.store.gather import Gather, run_copies

MIB = 1 << 20
POOL = 256 * MIB  # bytes of buffers (bare) or batch slots (link) each rank cycles through
_INDEX = struct.Struct("!I")  # a bare TCP request: the fetch's index


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2 or argv[0].startswith("-"):
        print("usage: peers_link.py SPEC [NODE] (run by benchmarks/peers.py)", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    fetches, depth = spec["fetches"], spec["depth"]
    if spec["via"] == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        me = comm.Get_rank()

        def bare_mpi(resident: Any, plans: list[Plan], slots: list[Any]) -> dict[str, Any]:
            return {
                "bare": _bare(comm, fetches[me], fetches[1 - me], depth),
                "typed": _typed(comm, resident, plans, slots, depth),
            }

        return _replay(spec, me, comm.Barrier, lambda: _mpi_node(comm, spec), bare_mpi)
    me = int(argv[1])
    control = _Control(me, spec["control"])

    def bare_tcp(resident: Any, plans: list[Plan], slots: list[Any]) -> dict[str, Any]:
        return _bare_tcp(me, fetches, depth, control, plans[me], slots)

    try:
        return _replay(spec, me, control.barrier, lambda: _grpc_node(me, spec, control), bare_tcp)
    finally:
        control.close()


def _replay(spec: dict[str, Any], me: int, barrier: Any, node: Any, bare: Any) -> int:
    """Build node ``me`` (``node()``: its closer and resident shard), replay the fetches
    bare (``bare(resident, plans, slots)``: the bare players) and through the link, meeting
    the other process at ``barrier()``; process 0 prints the seconds."""
    close, resident = node()
    try:
        plans = [
            _plan(resident, n, spec["fetches"][n], spec["spatial"], spec["via"]) for n in (0, 1)
        ]
        slots = {name: plans[me].slots() for name in ("typed", "link")}
        players = bare(resident, plans, slots["typed"])
        players["link"] = _link(resident, plans[me], slots["link"], spec["depth"])
        runs: dict[str, list[float]] = {name: [] for name in players}
        for rep in range(spec["reps"]):
            for name in list(players)[:: 1 if rep % 2 == 0 else -1]:
                play = players[name]
                play(2)
                barrier()
                t0 = time.perf_counter()
                play(None)
                barrier()
                runs[name].append(time.perf_counter() - t0)
        if spec["via"] == "mpi":  # the same fetches last (bare TCP sends no samples)
            for a, b in zip(slots["typed"], slots["link"], strict=True):
                if any(not np.array_equal(a[f], b[f]) for f in a):
                    raise SystemExit(f"node {me}: the link and typed mpi4py filled a slot unlike")
        if me == 0:
            print(json.dumps(runs), flush=True)
    finally:
        barrier()  # (neither side's link stops while the other still asks)
        close(resident)
    return 0


def _buffers(nbytes: list[int], n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Receive and send buffers for ``n`` fetches of up to ``max(nbytes)`` bytes, as many of
    each as fit in :data:`POOL` (cycled through: the bytes do not come from a cache), their
    pages in place."""
    biggest = max(nbytes)
    k = max(1, min(n, POOL // biggest))
    recv = [np.ones(biggest, np.uint8) for _ in range(k)]
    return recv, [np.ones(biggest, np.uint8) for _ in range(k)]


def _bare(comm: Any, into: list[list[int]], out: list[list[int]], depth: int) -> Any:
    """``play(count)``: ``count`` (``None``: all) of the fetches ``into`` received from the
    other rank while ``out`` are sent to it, ``depth`` in flight each way."""
    other = 1 - comm.Get_rank()
    n = max(len(into), len(out))
    rbuf, sbuf = _buffers([sum(f) for f in into + out], n)
    k = len(rbuf)

    def posts(i: int) -> list[Any]:
        reqs = []
        for sizes, buf, post in ((into, rbuf, comm.Irecv), (out, sbuf, comm.Isend)):
            if i < len(sizes):
                at = 0
                for m in sizes[i]:
                    reqs.append(post(buf[i % k][at : at + m], other, 0))
                    at += m
        return reqs

    return _windowed(n, posts, depth, _waitall)


def _bare_tcp(
    me: int, fetches: list[list[list[int]]], depth: int, control: _Control, plan: Plan, slots: Any
) -> dict[str, Any]:
    """``{"bare": play, ["typed": play]}``, ``play(count)``: ``count`` (``None``: all) of
    node ``me``'s fetches asked of the other process over plain blocking TCP sockets while
    it asks this one its own, ``depth`` connections each way: the asker sends a fetch's index
    (4 bytes) and receives its bytes with ``recv_into`` (``MSG_WAITALL``); a thread per
    connection on the owner answers with ``sendall`` from ready buffers. What a user would
    write to move the bytes; for blocks, ``typed`` also copies each sample's part into its
    batch slot amid its halo with numpy, as a user would (TCP has no datatypes)."""
    into = [sum(f) for f in fetches[me]]
    out = [sum(f) for f in fetches[1 - me]]
    rbuf, sbuf = _buffers(into + out, max(len(into), len(out)))
    k = len(rbuf)
    listener = socket.create_server(("127.0.0.1", 0))
    port = control.swap(listener.getsockname()[1])

    def answer(conn: socket.socket) -> None:
        with conn:
            while len(head := conn.recv(_INDEX.size, socket.MSG_WAITALL)) == _INDEX.size:
                (i,) = _INDEX.unpack(head)
                conn.sendall(memoryview(sbuf[i % k])[: out[i]])

    idle: SimpleQueue[socket.socket] = SimpleQueue()
    for _ in range(depth):
        idle.put(socket.create_connection(("127.0.0.1", port)))
    for _ in range(depth):
        threading.Thread(target=answer, args=(listener.accept()[0],), daemon=True).start()
    listener.close()

    def fetch(i: int, place: bool) -> None:
        conn = idle.get()
        try:
            conn.sendall(_INDEX.pack(i))
            view, got = memoryview(rbuf[i % k])[: into[i]], 0
            while got < len(view):
                n = conn.recv_into(view[got:], 0, socket.MSG_WAITALL)
                if not n:
                    raise SystemExit(f"node {me}: the other process closed a bare connection")
                got += n
        finally:
            idle.put(conn)
        if place:  # field after field, sample after sample, each part in C order
            slot, at = slots[i % len(slots)], 0
            for f in plan.fields:
                box = covered(f)[1]
                shape = tuple(b.stop - b.start for b in box)
                nbytes = math.prod(shape) * f.dtype.itemsize
                for j in range(len(plan.samples[i])):
                    part = rbuf[i % k][at : at + nbytes].view(f.dtype).reshape(shape)
                    slot[f.name][j][box] = part
                    at += nbytes

    pool = ThreadPoolExecutor(depth)
    players = {}
    for name, place in (("bare", False), ("typed", True))[: 1 + bool(plan.spatial)]:
        start = functools.partial(lambda i, place: pool.submit(fetch, i, place), place=place)
        players[name] = _windowed(len(into), start, depth, lambda f: f.result())
    return players


class _Control:
    """Where the two processes of a gRPC replay meet (node 0 listens on ``port``, node 1
    connects): a barrier is a byte each way, blocking, so no core spins while the other
    process finishes; ``swap`` trades a number (a port)."""

    def __init__(self, me: int, port: int) -> None:
        if me == 0:
            with socket.create_server(("127.0.0.1", port)) as listener:
                listener.settimeout(120)
                self.sock = listener.accept()[0]
        else:
            deadline = time.monotonic() + 120
            while True:
                try:
                    self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        self.sock.settimeout(600)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def swap(self, value: int) -> int:
        self.sock.sendall(_INDEX.pack(value))
        head = self.sock.recv(_INDEX.size, socket.MSG_WAITALL)
        if len(head) != _INDEX.size:
            raise SystemExit("the other process of the replay went away")
        return _INDEX.unpack(head)[0]

    def barrier(self) -> None:
        self.swap(0)

    def close(self) -> None:
        self.sock.close()


def _waitall(requests: list[Any]) -> None:
    from mpi4py import MPI

    MPI.Request.Waitall(requests)


def _mpi_node(comm: Any, spec: dict[str, Any]) -> tuple[Any, Any]:
    """This rank's service (its MPI link and residency; no gRPC server), its shard loaded."""
    me = comm.Get_rank()
    config = ServeConfig(socket=Path(spec["tmp"], f"link{me}.sock"))
    servicer = Servicer(
        config=config, listen=[], stop=Stop(), counters=Counters(), log=_quiet(), comm=comm
    )

    def close(resident: Any) -> None:
        servicer.residency.release(resident)
        servicer.close()

    return close, _load(servicer, spec["template"], me)


def _grpc_node(me: int, spec: dict[str, Any], control: _Control) -> tuple[Any, Any]:
    """Node ``me``'s service as ``datastore serve --tcp --peers --node`` builds it, less its
    Unix socket: the gRPC link, the TCP server with the ``Peers`` service (token checked)
    and the data listener; its shard loaded once the other node's is up."""
    from grpc_health.v1 import health

    from datastore.service.auth import TokenInterceptor, read_token
    from datastore.service.grpc_peers import GrpcPeers
    from datastore.service.listeners import add_services, bind_data, bind_tcp, new_server

    config = ServeConfig(
        socket=Path(spec["tmp"], f"link{me}.sock"),
        tcp=spec["peers"][me],
        token_file=Path(spec["token_file"]),
        peers=tuple(spec["peers"]),
        node=me,
    )
    token = read_token(config.token_file)
    link = GrpcPeers(config.peers, me, token, None, config.peer_timeout_s)
    servicer = Servicer(
        config=config, listen=[], stop=Stop(), counters=Counters(), log=_quiet(), peers=link
    )
    server = new_server(config.workers, [TokenInterceptor(token)])
    bind_tcp(server, config.tcp, None, None)
    data = bind_data(config.tcp, 0, None, None, config.peer_timeout_s)
    add_services(server, servicer, health.HealthServicer(), peers=True, data=data)
    server.start()

    def close(resident: Any) -> None:
        servicer.residency.release(resident)
        server.stop(None)
        data.close()
        servicer.close()

    control.barrier()  # both answer before either asks
    return close, _load(servicer, spec["template"], me)


def _quiet() -> JsonLog:
    return JsonLog(open(os.devnull, "w"))  # (open for the process's lifetime)


def _load(servicer: Servicer, template: str, me: int) -> Any:
    """Node ``me``'s shard of ``template`` resident in ``servicer``, every sample in RAM."""
    resident = servicer.residency.acquire(os.path.realpath(node_path(template, me)), template)
    if resident.owner is None:
        raise SystemExit(f"{template} is not sharded over the two nodes")
    resident.wait()
    for i in resident.store.keys.tolist():  # every sample of this shard in RAM
        for name in resident.reader.fields:
            resident.sample(int(i), name)
    return resident


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


def _plan(resident: Any, node: int, fetches: list[list[int]], spatial: Any, via: str) -> Plan:
    """Node ``node``'s fetches: the samples the other node owns, taken in turn, as many per
    fetch as the job's, whose bytes they must match (checked; over MPI, message by message:
    over gRPC the owner sends runs, cut where its store cuts them)."""
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
        if (cut != sizes) if via == "mpi" else (sum(cut) != sum(sizes)):
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
    from mpi4py.util.dtlib import from_numpy_dtype

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

    return _windowed(n, posts, depth, _waitall)


def _windowed(n: int, start: Any, depth: int, finish: Any) -> Any:
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
        out, n = slots[i % len(slots)], len(plan.samples[i])
        fetching = resident.start_fetch(plan.samples[i], plan.fields, plan.spatial, plan.block, out)
        skip = fetching.positions  # (all of them: the link zeroes their halo)
        pads = [c for f in plan.fields for c in batch_pad_copies(f, out[f.name], n, skip)]
        run_copies(pads, gather)
        return fetching

    def finish(fetching: Any) -> None:
        run_copies(fetching.result(never), gather)

    return _windowed(len(plan.samples), start, depth, finish)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

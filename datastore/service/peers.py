"""Services on several nodes forming one store, and their link over MPI (``mpiexec -n K
datastore serve``); :mod:`datastore.service.grpc_peers` is the same link over gRPC.

Each service owns the samples staged on its node's disk. When a dataset is sharded (``datastore
stage --mode shard``: nodes hold different files under the same path), a service asks every
peer which files it holds (``describe``), and from then on fetches from their owners the blocks
its local trainer ranks need (``fetch``): the owner sends block ``k``'s part inside the volume
straight from its resident sample, as the sample's contiguous runs (:class:`Pieces`; MPI
derived datatypes are slow in mpich), and the asker writes the zero halo. Fetches run in a
session's producer thread, so they are prefetched from the known order like the rest of a batch.

The requests are point-to-point MPI messages (pickled requests, raw replies) answered by a
thread in each service, so no service ever waits in a collective on a client's behalf. Every
wait has a deadline: a peer that died makes the request fail (``UNAVAILABLE``), never hang.

Replies travel on a tag per request, taken from a cycle of ``tag_span`` tags, and carry the
request's number (``rid``, never reused). A reply that comes after its request gave up stays in
MPI's queue under its tag; when the cycle comes round to that tag again, the asker takes it,
sees another ``rid``, and drops it (and the raw payload that follows it) before reading its
own reply: a late answer can never pass for a new one.
A dataset path may contain ``{node}``, filled in by each service with its own rank (several
services on one host, as in tests).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from datastore.service.errors import ServiceError

__all__ = ["Listing", "MpiPeers", "Peers", "Pieces", "node_path", "runs"]

Listing = tuple[bool, list[str], dict[str, tuple[str, tuple[int, ...]]]]
"""``(shardable, files held here, {field: (dtype, shape)})``: a node's view of a dataset."""

REQUEST = 1  # tag of every request; replies use a tag per request
FIRST_REPLY_TAG = 100
TAG_SPAN = 30000  # reply tags cycle through [FIRST_REPLY_TAG, +TAG_SPAN): MPI guarantees 32767
IDLE_NAP = (0.0005, 0.02)  # seconds between polls for requests: while busy, idle at most


MIN_RUN = 64 * 1024  # a piece cut into runs shorter than this on average is packed instead


@dataclass(frozen=True)
class Pieces:
    """A ``fetch`` reply sent straight from the store: the bytes of each ``array[box]`` of
    ``boxes`` (``(array, box)``), one after the other, as messages of contiguous runs."""

    boxes: Sequence[tuple[np.ndarray, tuple[slice, ...]]]

    def runs(self) -> list[np.ndarray]:
        """The bytes to send, in order, as 1-d uint8 views of the arrays where the boxes'
        parts are contiguous; a box cut into many short runs is packed (one copy)."""
        out: list[np.ndarray] = []
        for array, box in self.boxes:
            part = array[box]
            if not part.nbytes:
                continue
            cut = runs(part)
            if len(cut) > 1 and part.nbytes < MIN_RUN * len(cut):
                cut = [np.ascontiguousarray(part).reshape(-1).view(np.uint8)]
            out += cut
        return out


def runs(part: np.ndarray) -> list[np.ndarray]:
    """The contiguous runs of a strided view, in C order, as 1-d uint8 views of its memory."""
    if part.flags.c_contiguous:
        return [part.reshape(-1).view(np.uint8)]
    return [r for sub in part for r in runs(sub)]


def node_path(path: str, node: int) -> str:
    """``path`` with ``{node}`` replaced by this service's rank."""
    return path.replace("{node}", str(node))


class Peers(Protocol):
    """What a service asks of the other services of its store (over MPI or gRPC)."""

    node: int  # this service's index in the store
    nodes: int
    bytes_received: int
    sends_pieces: bool  # fetch replies are the parts inside the volume, not whole boxes

    def describe(self, dest: int, path: str) -> Listing:
        """Node ``dest``'s :data:`Listing` of the dataset clients call ``path``."""
        ...

    def fetch(self, dest: int, request: dict, out: np.ndarray) -> None:
        """Node ``dest``'s packed blocks into ``out`` (uint8): :meth:`Resident.blocks`, or,
        where the link :attr:`sends_pieces`, :meth:`Resident.pieces` (no halo outside the
        volume)."""
        ...

    def close(self, *, stop_all: bool) -> None:
        """Stop answering; ``stop_all``: this service is stopping on its own account."""
        ...


class MpiPeers:
    """Requests to and answers from the other services of one MPI job.

    Args:
        comm: an mpi4py communicator of the services (duplicated here).
        answer: ``answer(request) -> reply``: what this service replies to a peer's request; a
            reply is a picklable object, or a numpy array sent as raw bytes.
        timeout_s: how long a request may wait for its reply. Default: ``60``.
        tag_span: how many reply tags to cycle through (tests make it small to wrap quickly).
            Default: :data:`TAG_SPAN`.
    """

    def __init__(
        self,
        comm: Any,
        answer: Callable[[dict], Any],
        timeout_s: float = 60.0,
        tag_span: int = TAG_SPAN,
    ) -> None:
        self.comm = comm.Dup()
        self.node, self.nodes = self.comm.Get_rank(), self.comm.Get_size()
        self._answer = answer
        self.timeout_s = timeout_s
        self.tag_span = tag_span
        self._rids = itertools.count()
        self._tag_lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="datastore-peer")
        self.bytes_received = 0
        self.sends_pieces = True
        self._thread = threading.Thread(target=self._serve, name="datastore-peers", daemon=True)
        self._thread.start()

    # -- asking --------------------------------------------------------------------------------
    def _tag(self) -> tuple[int, int]:
        """``(reply tag, request number)`` of a new request."""
        with self._tag_lock:
            rid = next(self._rids)
        return FIRST_REPLY_TAG + rid % self.tag_span, rid

    def _wait(self, req: Any, dest: int, what: str, deadline: float) -> Any:
        while True:
            done, value = req.test()
            if done:
                return value
            if self._stop.is_set() or time.monotonic() > deadline:
                req.Cancel()
                raise ServiceError(
                    "UNAVAILABLE",
                    f"node {dest} did not answer {what} within {self.timeout_s:.0f} s",
                )
            time.sleep(0.0002)

    def _reply_to(self, dest: int, tag: int, rid: int, what: str, deadline: float) -> dict:
        """The envelope ``{"rid", ...}`` of request ``rid``, dropping late replies to earlier
        requests that used the same tag (and the raw payload that follows an ``"ok"``)."""
        while True:
            msg = self._wait(self.comm.irecv(source=dest, tag=tag), dest, what, deadline)
            if msg["rid"] == rid:
                return msg
            if "ok" in msg:  # a stale raw reply: take its bytes off the queue too
                stale = np.empty(msg["ok"], dtype=np.uint8)
                self._receive(dest, tag, stale, msg.get("runs", [msg["ok"]]), deadline)

    def ask(self, dest: int, request: dict) -> Any:
        """Send ``request`` to node ``dest``; its pickled reply."""
        tag, rid = self._tag()
        deadline = time.monotonic() + self.timeout_s
        self.comm.send({**request, "tag": tag, "rid": rid}, dest=dest, tag=REQUEST)
        reply = self._reply_to(dest, tag, rid, request["kind"], deadline)["reply"]
        if isinstance(reply, dict) and "error" in reply:
            raise ServiceError(reply["code"], f"node {dest}: {reply['error']}")
        return reply

    def describe(self, dest: int, path: str) -> Listing:
        """Node ``dest``'s listing of ``path``."""
        return self.ask(dest, {"kind": "describe", "path": path})

    def fetch(self, dest: int, request: dict, out: np.ndarray) -> None:
        """Send ``request`` to node ``dest`` and receive its raw reply into ``out`` (uint8):
        one message, or the runs of :class:`Pieces` (``request["pieces"]``: sent straight
        from the owner's store), each straight into its place in ``out``."""
        tag, rid = self._tag()
        deadline = time.monotonic() + self.timeout_s
        request = {**request, "tag": tag, "rid": rid, "nbytes": out.nbytes}
        self.comm.send(request, dest=dest, tag=REQUEST)
        status = self._reply_to(dest, tag, rid, request["kind"], deadline)
        if "ok" not in status:
            reply = status["reply"]
            raise ServiceError(reply["code"], f"node {dest}: {reply['error']}")
        if status["ok"] != out.nbytes:
            raise ServiceError(
                "INTERNAL", f"node {dest} sent {status['ok']} bytes, not {out.nbytes}"
            )
        self._receive(dest, tag, out, status.get("runs", [out.nbytes]), deadline)
        self.bytes_received += out.nbytes

    def _receive(
        self, dest: int, tag: int, out: np.ndarray, sizes: list[int], deadline: float
    ) -> None:
        """The messages of ``sizes`` bytes from ``dest`` on ``tag``, one after the other in
        ``out``; polled without naps (the payload follows its envelope) until ``deadline``."""
        from mpi4py import MPI

        at, reqs = 0, []
        for n in sizes:
            reqs.append(self.comm.Irecv(out[at : at + n], source=dest, tag=tag))
            at += n
        while not MPI.Request.Testall(reqs):
            if self._stop.is_set() or time.monotonic() > deadline:
                for r in reqs:
                    r.Cancel()
                raise ServiceError("UNAVAILABLE", f"node {dest} did not send its blocks in time")
            time.sleep(0)

    def tell_all(self, request: dict) -> None:
        """Send ``request`` to every other node, expecting no reply."""
        for dest in range(self.nodes):
            if dest != self.node:
                self.comm.send({**request, "tag": None}, dest=dest, tag=REQUEST)

    # -- answering -----------------------------------------------------------------------------
    def _serve(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        nap = IDLE_NAP[0]
        while not self._stop.is_set():
            if not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=REQUEST, status=status):
                time.sleep(nap)  # longer naps while idle: no CPU burnt between jobs
                nap = min(2 * nap, IDLE_NAP[1])
                continue
            nap = IDLE_NAP[0]
            source = status.Get_source()
            request = self.comm.recv(source=source, tag=REQUEST)
            self._pool.submit(self._reply, source, request)

    def _reply(self, source: int, request: dict) -> None:
        tag, rid = request["tag"], request.get("rid")
        try:
            reply = self._answer(request)
        except ServiceError as exc:
            reply = {"error": str(exc), "code": exc.code}
        except Exception as exc:  # a peer's bad request must not kill this service
            reply = {"error": f"internal error: {type(exc).__name__}", "code": "INTERNAL"}
        if tag is None:
            return
        if isinstance(reply, Pieces):  # straight from the store: nothing packed
            from mpi4py import MPI

            cut = reply.runs()
            sizes = [r.nbytes for r in cut]
            self.comm.send({"rid": rid, "ok": sum(sizes), "runs": sizes}, dest=source, tag=tag)
            MPI.Request.Waitall([self.comm.Isend(r, dest=source, tag=tag) for r in cut])
        elif isinstance(reply, np.ndarray):
            raw = np.ascontiguousarray(reply).view(np.uint8)
            self.comm.send({"rid": rid, "ok": raw.nbytes}, dest=source, tag=tag)
            self.comm.Send(raw, dest=source, tag=tag)
        else:
            self.comm.send({"rid": rid, "reply": reply}, dest=source, tag=tag)

    def close(self, *, stop_all: bool) -> None:
        """Stop answering; ``stop_all``: tell the other services to stop too (one MPI job
        lives and ends together)."""
        if stop_all:
            self.tell_all({"kind": "shutdown", "node": self.node})
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        self.comm.Free()

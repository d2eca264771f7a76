"""The link between the services of one store over MPI (``mpiexec -n K datastore serve``);
:mod:`datastore.service.grpc_peers` is the same link over gRPC, and
:mod:`datastore.service.peer_link` what both share (the requests, :class:`Pieces` replies,
where the bytes land).

The owner sends a fetch's part as its contiguous runs
(:class:`~datastore.service.peer_link.Pieces`); a part amid its halo lands aside and is copied
in. MPI derived datatypes would spare that copy, but in mpich 5 (shared memory) a subarray
type moves 0.2-0.9 GB/s where contiguous bytes move 2-7 GB/s.

The requests are point-to-point MPI messages (pickled requests, raw replies), so no service
ever waits in a collective on a client's behalf. One thread per service (the link's) makes
every MPI call but one: where MPI runs ``MPI_THREAD_MULTIPLE`` (mpi4py's default), a thread
asking sends its request itself, so it is on its way before the link's thread wakes (a
thread hop less per fetch on the way there). The link answers a fetch of samples in RAM
itself, at once (views of the store: no read, no file system call; a box of short runs is
packed there, one copy), and hands every other request to a pool (a describe, a read from
disk): two thread hops less per fetch on the owner. What is left of a fetch's way there and
back is each side's link thread noticing a message: it polls (MPI cannot wake a sleeping
thread), so on a loaded host that is the wait for a core (see docs/benchmarks.md). For
:data:`SPIN_S` after a fetch was asked, and again after its envelope came, the link polls
without a nap, yielding the core: the reply is due, and mpich moves a transfer only inside
MPI calls (a 0.2 ms nap per step cost a block fetch about 2 ms).
Every wait has a deadline: a peer that hangs or dies mid-reply makes the request fail
(``UNAVAILABLE``), never hang.

Replies travel on a tag per request, taken from a cycle of ``tag_span`` tags, and carry the
request's number (``rid``, never reused). A reply that comes after its request gave up stays in
MPI's queue under its tag; when the cycle comes round to that tag again, the asker takes it,
sees another ``rid``, and drops it (and the raw payload that follows it) before reading its
own reply: a late answer can never pass for a new one.
A fetch that tells the sizes of its reply's messages (``expect``: the asker computes them as the
owner cuts them, :func:`~datastore.maths.delivery.covered_sizes`) has its receives posted with
the request, on a second tag of its own (the next ``tag_span`` tags), and the owner sends the
bytes with no envelope before them (an owner holding them cut otherwise recuts them; one
holding another total answers an error on the reply tag, as it does any error): a message and
a pickle less per fetch, and the receives ready before the bytes leave. Its bytes carry no
``rid``, so a fetch that gives up while they may still come (its deadline, or abandoned)
cancels its receives, last first, and receives what may still come aside, on that tag; until
it came, or the owner's refusal came instead (an error on the reply tag: no bytes follow), no
fetch to that owner uses the tag (where none is free, a fetch is told its sizes by an envelope
as before). A fetch told its sizes by an envelope that gives up before its bytes came does the
same on its reply tag, which no request to that owner then uses: late bytes are received by
their size, never read as an envelope. No two requests to one owner in flight share a tag: a
request waits for one to be free (within the timeout) where all ``tag_span`` are in use or
await late bytes. A receive whose bytes began to land cannot be cancelled: where one has not
ended :data:`CANCEL_S` after its fetch gave up (or when the link closes), the fetch is over
but its buffers stay lent (:meth:`Pending.freed`, which a stream waits for before it reuses
the batch slot) and its tag unused, until the receive ended; a link that closes keeps the
buffers of those not ended, and of its sends not ended, for the life of the process (MPI
may move their bytes up to ``MPI_Finalize``, after Python freed its objects). A request that
cannot be posted (no pickle, a buffer MPI refuses) fails naming its node, its receives
cancelled (none was matched: nothing was asked) and its tag free again.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datastore.maths.subarray import view
from datastore.ranks.subarrays import ASIDE_KEPT, Asides, keep_until_exit
from datastore.service.errors import ServiceError
from datastore.service.peer_link import (
    Box,
    Listing,
    Pending,
    Pieces,
    Segments,
    cut_into,
    fitted,
    nbytes,
    sizes_of,
    targets,
    zero_rest,
)
from datastore.service.peer_stats import STATS_ENV, ExchangeStats

__all__ = ["MpiPeers"]

REQUEST = 1  # tag of every request; replies use a tag per request
FIRST_REPLY_TAG = 100
TAG_SPAN = 16000  # reply tags cycle through [FIRST_REPLY_TAG, +TAG_SPAN), the bytes of a fetch
# whose receives were posted with it through the next TAG_SPAN tags: MPI guarantees 32767
FLIGHT_NAP = 0.0002  # seconds between polls while a request or a send is in flight
BUSY_NAP = 0.0002  # seconds between polls for requests within BUSY_S of the last one
BUSY_S = 1.0
IDLE_NAP = 0.02  # seconds between polls once idle longer: no CPU burnt between jobs
SPIN_S = 0.02  # seconds a fetch's envelope, then its bytes, are polled for without a nap
CANCEL_S = 1.0  # seconds a fetch's cancelled receives are given to end before it is let go
STOPPING = "this service is stopping"


def _preposted(request: dict, out: list[np.ndarray] | None) -> list[tuple[int, int, int]] | None:
    """Where the messages a fetch ``request`` expects land in ``out`` (``[(buffer, start,
    stop)]``); ``None`` where it expects none or they do not fit ``out`` (a fetch of no
    bytes would be over before the owner's answer, an error included)."""
    if out is None or "expect" not in request:
        return None
    return cut_into(sizes_of(request["expect"]), [b.nbytes for b in out]) or None


class MpiPeers:
    """Requests to and answers from the other services of one MPI job.

    One thread (the link's) makes the service's MPI calls: it takes peers' requests (answering
    those ``at_once`` answers, the others on a pool), posts the sends and receives the
    service's threads ask for, and completes them; a thread asking sends its request itself
    where MPI is ``MPI_THREAD_MULTIPLE`` (else the link's thread does), then waits on an
    event, never inside MPI. So many requests are in flight at once (a stream's fetches of the
    next steps, to every owner), and a reply's bytes land straight in the asker's buffer
    (a :data:`Box` part of it that is not contiguous, such as a
    block's part inside the volume amid its halo, lands in a reused buffer and is copied in by
    the thread that takes the result).

    Args:
        comm: an mpi4py communicator of the services (duplicated here).
        answer: ``answer(request) -> reply``: what this service replies to a peer's request; a
            reply is a picklable object, a numpy array sent as raw bytes, or :class:`Pieces`.
        timeout_s: how long a request may wait for its reply. Default: ``60``.
        tag_span: how many reply tags to cycle through (tests make it small to wrap quickly).
            Default: :data:`TAG_SPAN`.
        at_once: ``at_once(request) -> reply | None``: ``answer``'s reply where it is ready in
            memory, made on the link's thread (so it must not read or wait); ``None`` hands
            the request to ``answer`` on the pool. Default: every request to the pool.
    """

    def __init__(
        self,
        comm: Any,
        answer: Callable[[dict], Any],
        timeout_s: float = 60.0,
        tag_span: int = TAG_SPAN,
        at_once: Callable[[dict], Any] | None = None,
    ) -> None:
        self.comm = comm.Dup()
        self.node, self.nodes = self.comm.Get_rank(), self.comm.Get_size()
        self._answer = answer
        self._at_once = at_once or (lambda request: None)
        self.timeout_s = timeout_s
        self.tag_span = tag_span
        self.bytes_received = 0
        self.stats = ExchangeStats(os.environ.get(STATS_ENV, ""), self.node)
        self._multiple = _thread_multiple()
        self._rids = itertools.count()
        self._asides = Asides(ASIDE_KEPT)
        self._tag_lock = threading.Lock()
        self._ask_lock = threading.Lock()  # askers' requests vs the stop and the comm's Free
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # work for the link's thread
        self._calls: list[_Call] = []  # (the link's thread only) requests awaiting replies
        # (owner, rid % tag_span, kind) -> how many fetches' late bytes may still come on
        # that slot's tag of ``kind``: "data" (a fetch posted with its request), "reply" (one
        # told its sizes by an envelope)
        self._late: collections.Counter[tuple[int, int, str]] = collections.Counter()
        self._busy: set[tuple[int, int]] = set()  # (owner, rid % tag_span) of those in flight
        self._tags = threading.Condition(self._tag_lock)  # (a request ended: its tags free)
        self._drains: list[_Drain] = []  # (the link's thread only) late bytes taken aside
        self._lent: list[_Call] = []  # (the same) over, a receive still landing in its buffers
        self._sends: list[tuple[list[Any], Any]] = []  # (requests, what they send from)
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="datastore-peer")
        self._thread = threading.Thread(target=self._run, name="datastore-peers", daemon=True)
        self._thread.start()

    # -- asking (any thread) --------------------------------------------------------------------
    def _start(self, dest: int, request: dict, out: list[np.ndarray] | None = None) -> _Call:
        runs = _preposted(request, out)
        try:
            rid, posted = self._take_tag(dest, runs is not None)
        except ServiceError as exc:
            call = _Call(dest, 0, -1, request["kind"], out, 0.0, error=exc)
            call.over()
            return call
        runs = runs if posted else None
        tag = FIRST_REPLY_TAG + rid % self.tag_span
        call = _Call(dest, tag, rid, request["kind"], out, time.monotonic() + self.timeout_s)
        message = {k: v for k, v in request.items() if k != "expect" or runs is not None}
        message.update(tag=tag, rid=rid)
        if out is not None:
            message["nbytes"] = call.nbytes
        if runs is not None:  # its bytes come on a tag of their own, no envelope before them
            call.data_tag, call.runs = tag + self.tag_span, runs
            call.sizes, call.enveloped = [b - a for _, a, b in runs], call.asked
            message["data_tag"] = call.data_tag
        with self._ask_lock:  # handed to the link before its stop (its last drain sees it)
            if self._stop.is_set():
                call.error = ServiceError("UNAVAILABLE", f"node {dest} was not asked: {STOPPING}")
                self._free_tag(call)
                call.over()
                return call
            sent = None
            if self._multiple:  # the receives, then the request, go out from this thread
                try:
                    if runs is not None:
                        call.recvs = self._irecvs(dest, call.data_tag, call.out or [], runs)
                    sent = self.comm.isend(message, dest=dest, tag=REQUEST)
                except Exception as exc:
                    self._unsent(call, exc)
                    return call
            self._do(lambda: self._post(call, sent, message))
        return call

    def _unsent(self, call: _Call, exc: Exception) -> None:
        """``call``'s request could not go out (``exc``: an unpicklable request, a buffer MPI
        refuses): it fails naming its owner, the receives posted for it are cancelled and its
        tag is free again. Those receives were matched by nothing (no request went out, and
        no late bytes come on a tag posted on), so each cancel ends its receive at once."""
        from mpi4py import MPI

        recvs = exc.posted if isinstance(exc, _Unposted) else call.recvs or []
        cause = exc.__cause__ if isinstance(exc, _Unposted) else exc
        for r in reversed(recvs):
            r.Cancel()
        MPI.Request.Waitall(recvs)
        call.recvs = None
        why = f"its {call.what} request could not be sent ({type(cause).__name__}: {cause})"
        call.error = ServiceError("INTERNAL", f"node {call.dest} was not asked: {why}")
        self._free_tag(call)
        call.over()

    def _take_tag(self, dest: int, posting: bool) -> tuple[int, bool]:
        """A request number for a request to ``dest`` whose tags no request in flight to it
        uses (waiting for one to end where all do), and whether its fetch's receives may be
        posted with it (``posting``, and no late bytes may come on its data tag; else it is
        told its sizes by an envelope).

        Raises:
            ServiceError: ``UNAVAILABLE``, no tag freed within the timeout.
        """
        deadline = time.monotonic() + self.timeout_s
        with self._tags:
            while True:
                free = None
                for _ in range(self.tag_span):
                    rid = next(self._rids)
                    slot = (dest, rid % self.tag_span)
                    if slot in self._busy or self._late[(*slot, "reply")]:
                        continue
                    if not posting or not self._late[(*slot, "data")]:
                        self._busy.add(slot)
                        return rid, posting
                    free = rid if free is None else free
                if free is not None:
                    self._busy.add((dest, free % self.tag_span))
                    return free, False
                if not self._tags.wait(deadline - time.monotonic()):
                    why = f"each of its {self.tag_span} tags was in flight or awaited late bytes"
                    why += f" for {self.timeout_s:g} s"
                    raise ServiceError("UNAVAILABLE", f"node {dest} was not asked: {why}")

    def _slot(self, call: _Call) -> tuple[int, int]:
        """``call``'s place in the cycle of tags to its owner: ``(owner, rid % tag_span)``."""
        return call.dest, call.rid % self.tag_span

    def _free_tag(self, call: _Call) -> None:
        with self._tags:
            self._busy.discard(self._slot(call))
            self._tags.notify_all()

    def _mark_late(self, call: _Call) -> None:
        """Late bytes of ``call`` may still come on its tag: no request to its owner uses the
        tag till they came (its reply tag may still carry an envelope where it is the data
        tag that awaits them)."""
        with self._tags:
            self._late[(*self._slot(call), _late_tag(call))] += 1

    def _unmark_late(self, call: _Call) -> None:
        """No more late bytes of ``call`` can come: its tag is free again (for it)."""
        key = (*self._slot(call), _late_tag(call))
        with self._tags:
            self._late[key] -= 1
            if self._late[key] <= 0:
                del self._late[key]
            self._tags.notify_all()

    def _finish(self, call: _Call) -> Any:
        """``call``'s reply, once it came (the link's thread fails it at its deadline)."""
        if not call.done.wait(self.timeout_s + 5.0):  # the link's thread itself is stuck
            call.error = ServiceError("UNAVAILABLE", f"node {call.dest}: the link is stuck")
        if call.error is not None:
            raise call.error
        reply = call.reply
        if isinstance(reply, dict) and "error" in reply:
            raise ServiceError(reply["code"], f"node {call.dest}: {reply['error']}")
        unpack, call.unpack = call.unpack, []
        for box, aside in unpack:
            dst = view(*box)
            np.copyto(dst, aside.view(dst.dtype).reshape(dst.shape))
            zero_rest(box)
            self._asides.give(aside)
        return reply

    def ask(self, dest: int, request: dict) -> Any:
        """Send ``request`` to node ``dest``; its pickled reply."""
        return self._finish(self._start(dest, request))

    def describe(self, dest: int, path: str) -> Listing:
        """Node ``dest``'s listing of ``path``."""
        return self.ask(dest, {"kind": "describe", "path": path})

    def start(self, dest: int, request: dict, out: Segments) -> Pending:
        """Send ``request`` to node ``dest``, its raw reply to land in ``out`` (uint8
        buffers, filled one after the other): one message, or the runs of :class:`Pieces`
        (sent straight from the owner's store), each received straight into its place. A run
        must not straddle two buffers of ``out`` (the owner cuts runs within its boxes).
        Where ``request["expect"]`` (:func:`expect`) tells the messages' sizes and they fit
        ``out``, the receives are posted with the request and the bytes come without an
        envelope before them (a message and a wake-up less per fetch)."""
        into, unpack = [], []
        for t in targets(out):
            if not isinstance(t, tuple):
                into.append(t)
            elif view(*t).flags.c_contiguous:  # in place, its box's halo zeroed now
                into.append(view(*t).reshape(-1).view(np.uint8))
                zero_rest(t)
            else:  # received aside, copied in by :meth:`Pending.result`, its halo zeroed
                unpack.append((t, self._asides.take(nbytes(t))))
                into.append(unpack[-1][1])
        into = [t for t in into if t.nbytes]
        call = self._start(dest, request, into)
        call.unpack = unpack
        return Pending(
            call.done, lambda: self._finish(call), lambda: self._abandon(call), call.freed
        )

    def fetch(self, dest: int, request: dict, out: Segments) -> None:
        """:meth:`start`, waiting for the reply."""
        self.start(dest, request, out).result()

    def _abandon(self, call: _Call) -> None:
        """No longer wait for ``call``'s reply, unless its bytes are already coming (those
        land where they were to: its buffers stay in use until :meth:`Pending.wait` says)."""

        def drop() -> None:
            if call not in self._calls:
                return
            if call.data_tag is not None:
                if not call.let_go:
                    why = "was no longer waited for"
                    self._cancel(call, self._failure(call, why), late=True)
            elif call.recvs is None:
                self._give_up(call, "was no longer waited for")

        self._do(drop)

    def tell_all(self, request: dict) -> None:
        """Send ``request`` to every other node, expecting no reply."""
        for dest in range(self.nodes):
            if dest != self.node:
                message = {**request, "tag": None}
                self._do(lambda d=dest, m=message: self._isend(m, d, REQUEST))

    def _do(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the link's thread (which makes every MPI call)."""
        self._inbox.put(work)
        self._wake.set()

    # -- the link's thread ---------------------------------------------------------------------
    def _run(self) -> None:
        from mpi4py import MPI

        last = 0.0  # when a peer last asked, or this service last had a request in flight
        while not self._stop.is_set():
            self._drain()
            asked = self._requests(MPI)
            moved = self._progress(MPI)
            now = time.monotonic()
            if asked or self._calls:
                last = now
            if asked or moved:
                continue
            if self._fetch_young(now):
                time.sleep(0)  # its reply is due: poll again at once, yielding the core
                continue
            # a reply in flight is polled for at once; a request is taken within a short nap
            # while a job runs, a long one when idle (no CPU burnt between jobs)
            if self._calls or self._sends or self._lent:  # (lent: its bytes need our polls)
                nap = FLIGHT_NAP
            else:
                nap = BUSY_NAP if now - last < BUSY_S else IDLE_NAP
            if self._wake.wait(nap):
                self._wake.clear()
        self._drain()
        deadline = time.monotonic() + 1.0  # what was being sent goes out, if the peers take it
        while self._sends and time.monotonic() < deadline:
            self._progress(MPI)
            time.sleep(FLIGHT_NAP)
        for call in list(self._calls):  # their buffers lent till their receives end
            if not call.let_go:
                for r in reversed(call.recvs or []):
                    r.Cancel()
            call.error = self._failure(call, f"was not asked: {STOPPING}")
            self._done(call, lent=bool(call.recvs))
            if call.recvs:
                self._lent.append(call)
        deadline = time.monotonic() + CANCEL_S  # where one cannot end, its buffers stay lent
        while self._lent and time.monotonic() < deadline:
            for call in list(self._lent):
                if MPI.Request.Testall(call.recvs):
                    self._lent.remove(call)
                    call.freed.set()
            time.sleep(FLIGHT_NAP)
        # what has not ended may still move bytes till MPI finalizes, after Python freed its
        # objects: their buffers must outlive it
        for unended in (*self._sends, *self._drains, *self._lent):
            keep_until_exit(unended)

    def _fetch_young(self, now: float) -> bool:
        """Whether a fetch was asked, or its envelope came, less than :data:`SPIN_S` ago."""
        return any(
            c.out is not None and now - (c.asked if c.recvs is None else c.enveloped) < SPIN_S
            for c in self._calls
        )

    def _drain(self) -> None:
        while True:
            try:
                work = self._inbox.get_nowait()
            except queue.Empty:
                return
            work()

    def _isend(self, message: Any, dest: int, tag: int) -> None:
        self._sends.append(([self.comm.isend(message, dest=dest, tag=tag)], message))

    def _post(self, call: _Call, sent: Any, message: dict) -> None:
        """Await ``call``'s reply; its request ``message`` is sent (``sent``), or sent now
        (after the receives of its bytes, where it tells their sizes)."""
        if sent is None:
            try:
                if call.data_tag is not None:
                    call.recvs = self._irecvs(call.dest, call.data_tag, call.out or [], call.runs)
                self._isend(message, call.dest, REQUEST)
            except Exception as exc:
                self._unsent(call, exc)
                return
        else:
            self._sends.append(([sent], message))
        self._calls.append(call)
        if call.out is not None:
            self.stats.begin()

    def _requests(self, MPI: Any) -> bool:
        """Take the peers' requests: answer here those the service answers at once, hand the
        others to the pool; whether there were any."""
        any_ = False
        status = MPI.Status()
        while True:
            msg = self.comm.improbe(source=MPI.ANY_SOURCE, tag=REQUEST, status=status)
            if msg is None:
                return any_
            any_ = True
            source, request = status.Get_source(), msg.recv()
            reply = _answered(self._at_once, request)
            if reply is None:
                try:
                    self._pool.submit(self._reply, source, request)
                    continue
                except RuntimeError:  # the pool is shut: closing (this thread must go on)
                    reply = {"error": STOPPING, "code": "UNAVAILABLE"}
            self._send(source, request, reply, _raw(reply))

    def _progress(self, MPI: Any) -> bool:
        """Advance every request in flight and every send; whether anything completed."""
        moved = False
        now = time.monotonic()
        for call in list(self._calls):
            if call.let_go:
                moved = self._ending(MPI, call, now) or moved
            elif call.data_tag is not None:
                moved = self._progress_posted(MPI, call, now) or moved
            elif call.recvs is None:
                msg = self.comm.improbe(source=call.dest, tag=call.tag)
                if msg is not None:
                    moved = True
                    env = _envelope_in(msg)
                    if env is not None:
                        self._envelope(call, env)
                elif now > call.deadline:
                    self._give_up(call, f"did not answer {call.what} within {self.timeout_s:g} s")
            elif MPI.Request.Testall(call.recvs):
                moved = True
                self.bytes_received += call.nbytes
                self._done(call, call.nbytes)
            elif now > call.deadline:  # its bytes may come yet: taken aside when they do
                why = f"did not send its blocks within {self.timeout_s:g} s"
                self._cancel(call, self._failure(call, why), late=True)
                moved = True
        for sent in list(self._sends):
            if MPI.Request.Testall(sent[0]):
                self._sends.remove(sent)
                moved = True
        for call in list(self._lent):
            statuses = [MPI.Status() for _ in call.recvs or []]
            if MPI.Request.Testall(call.recvs, statuses):  # nothing lands in its buffers now
                self._lent.remove(call)
                self._settle(call, statuses)
                self._unmark_late(call)
                call.freed.set()
                moved = True
        for drain in list(self._drains):
            if MPI.Request.Testall(drain.recvs):  # the late bytes came, or never will
                self._drains.remove(drain)
                self._unmark_late(drain.call)
            elif drain.call.data_tag is not None:
                moved = self._refused_late(drain) or moved
        return moved

    def _refused_late(self, drain: _Drain) -> bool:
        """Look for the owner's answer to ``drain``'s fetch on its reply tag where no request
        uses that tag now: an error there (the owner refused it after it gave up) means its
        bytes never come, so the receives awaiting them are cancelled (the tag then free)."""
        call = drain.call
        with self._tags:  # (no request takes the tag meanwhile: its envelope is never taken)
            if self._slot(call) in self._busy or self._late[(*self._slot(call), "reply")]:
                return False
            msg = self.comm.improbe(source=call.dest, tag=call.tag)
        if msg is None:
            return False
        env = _envelope_in(msg)
        if env is not None:
            self._drop_stale(call, env)
        return True

    def _progress_posted(self, MPI: Any, call: _Call, now: float) -> bool:
        """Advance a fetch whose receives went out with its request: its bytes in, or the
        owner's envelope instead (an error), or its deadline; whether it moved."""
        if MPI.Request.Testall(call.recvs):
            self.bytes_received += call.nbytes
            self._done(call, call.nbytes)
            return True
        msg = self.comm.improbe(source=call.dest, tag=call.tag)
        if msg is not None:
            env = _envelope_in(msg)
            if env is None:  # not an envelope, dropped: ours is still to come
                return True
            if env["rid"] != call.rid:
                self._drop_stale(call, env)
            elif isinstance(env.get("reply"), dict) and "error" in env["reply"]:
                self._cancel(call, None, env["reply"])  # (raised by the asker's thread)
            else:  # bytes on the reply tag, or a reply that is no bytes: not what was asked
                self._drop_stale(call, env)
                why = "answered the fetch without its bytes"
                self._cancel(call, self._failure(call, why, "INTERNAL"))
            return True
        if now > call.deadline:
            why = f"did not send its blocks within {self.timeout_s:g} s"
            self._cancel(call, self._failure(call, why), late=True)
            return True
        return False

    def _ending(self, MPI: Any, call: _Call, now: float) -> bool:
        """Advance a fetch whose receives were cancelled: over once none can still land (the
        bytes of those cancelled taken aside when they come, where they may), or once one
        begun (matched: MPI cannot cancel it) has not ended after :data:`CANCEL_S`. Its
        buffers then stay lent (:meth:`Pending.freed`) and its tag unused till it ended."""
        statuses = [MPI.Status() for _ in call.recvs or []]
        if MPI.Request.Testall(call.recvs, statuses):
            self._settle(call, statuses)
            self._done(call)
            return True
        if now > call.let_go:
            self._mark_late(call)
            self._lent.append(call)
            self._done(call, lent=True)
            return True
        return False

    def _settle(self, call: _Call, statuses: list[Any]) -> None:
        """``call``'s cancelled receives ended (``statuses``): the bytes of those cancelled,
        and of those never posted (after them), taken aside when they come, where they may."""
        cut = [k for k, st in enumerate(statuses) if st.Is_cancelled()]
        cut += range(len(statuses), len(call.sizes))
        if cut and call.late:
            self._drain_late(call, [call.sizes[k] for k in cut])

    def _cancel(
        self, call: _Call, error: ServiceError | None, reply: Any = None, late: bool = False
    ) -> None:
        """End ``call`` without its bytes (``error``, or the owner's ``reply``): its receives
        are cancelled, and it is over once none can still land (or after :data:`CANCEL_S`);
        ``late``: the owner may send them yet. Cancelled last first, so a message that comes
        meanwhile lands in its own receive or in none (never in the next one's)."""
        for r in reversed(call.recvs or []):
            r.Cancel()
        call.error, call.reply, call.late = error, reply, late
        call.let_go = time.monotonic() + CANCEL_S

    def _drain_late(self, call: _Call, sizes: list[int]) -> None:  # (before it is freed)
        """Receive aside the messages of ``sizes`` that may still come on the tag ``call``'s
        bytes use, the only receives posted there until they came: no later request uses the
        tag till then, so late bytes never land in a fetch nor pass for an envelope, and the
        owner's sends end."""
        tag = call.tag if call.data_tag is None else call.data_tag
        aside = [np.empty(n, np.uint8) for n in sizes]
        self._mark_late(call)
        self._drains.append(_Drain(call, self._irecvs(call.dest, tag, aside, sizes), aside))

    def _failure(self, call: _Call, why: str, code: str = "UNAVAILABLE") -> ServiceError:
        return ServiceError(code, f"node {call.dest} {why}")

    def _drop_stale(self, call: _Call, env: dict) -> None:
        """Drop ``env``, a reply on ``call``'s tag that is not its own (a late one), and the
        raw bytes that follow it on that tag, if any (MPI's order: before ours); a refusal of
        a fetch whose late bytes are awaited on its data tag ends that wait (none come)."""
        if "ok" in env:
            stale = [np.empty(n, np.uint8) for n in env["runs"]]
            self._sends.append((self._irecvs(call.dest, call.tag, stale, env["runs"]), stale))
            return
        for drain in self._drains:
            late = drain.call
            if late.dest == call.dest and late.rid == env["rid"] and late.data_tag is not None:
                for r in reversed(drain.recvs):  # (matched by nothing: each ends at once)
                    r.Cancel()

    def _envelope(self, call: _Call, env: dict) -> None:
        """``call``'s reply envelope ``env``: its reply, or the raw runs to receive; a late
        reply to an earlier request on the same tag is dropped (its raw bytes too)."""
        if env["rid"] != call.rid:
            self._drop_stale(call, env)
            return
        if "ok" not in env:
            call.reply = env["reply"]
            self._done(call)
            return
        runs = cut_into(env["runs"], [b.nbytes for b in call.out or []])
        if call.out is None or env["ok"] != call.nbytes or runs is None:
            want = "nothing" if call.out is None else f"{call.nbytes} bytes in its boxes"
            self._give_up(call, f"sent {env['ok']} bytes as {env['runs']}, not {want}", "INTERNAL")
        else:
            call.sizes, call.enveloped = env["runs"], time.monotonic()
            try:
                call.recvs = self._irecvs(call.dest, call.tag, call.out, runs)
            except _Unposted as exc:  # (a buffer MPI refuses) the bytes are received aside
                call.recvs, cause = exc.posted, exc.__cause__
                why = f"answered, but the bytes could not be received ({type(cause).__name__}: "
                self._cancel(call, self._failure(call, f"{why}{cause})", "INTERNAL"), late=True)

    def _irecvs(self, dest: int, tag: int, out: list[np.ndarray], runs: Any) -> list[Any]:
        """Receives of ``runs`` (``[(buffer, start, stop)]``, or sizes: one buffer each).

        Raises:
            _Unposted: one could not be posted (those posted before it are in it).
        """
        if runs and isinstance(runs[0], int):
            runs = [(k, 0, n) for k, n in enumerate(runs)]
        posted: list[Any] = []
        try:
            for k, a, b in runs:
                posted.append(self.comm.Irecv(out[k][a:b], source=dest, tag=tag))
        except Exception as exc:
            raise _Unposted(posted) from exc
        return posted

    def _done(self, call: _Call, nbytes: int = 0, lent: bool = False) -> None:
        """``call`` is over (``nbytes``: the raw bytes it received; ``lent``: a receive may
        still land in its buffers)."""
        self._calls.remove(call)
        self._free_tag(call)
        if call.out is not None:
            now = time.monotonic()
            legs = (call.enveloped - call.asked, now - call.enveloped) if nbytes else (0.0, 0.0)
            self.stats.end(nbytes, call.sizes, legs)
        call.over(lent)

    def _give_up(self, call: _Call, why: str, code: str = "UNAVAILABLE") -> None:
        call.error = self._failure(call, why, code)
        self._done(call)

    # -- answering -----------------------------------------------------------------------------
    def _reply(self, source: int, request: dict) -> None:
        """(A pool thread) ``request``'s reply, handed to the link's thread to send."""
        reply = _answered(self._answer, request)
        raw = _raw(reply)  # (runs cut here, off the link's thread)
        self._do(lambda: self._send(source, request, reply, raw))

    def _send(self, dest: int, request: dict, reply: Any, raw: list[np.ndarray] | None) -> None:
        """Send ``request``'s reply: pickled, or its envelope and its ``raw`` messages."""
        tag, rid = request["tag"], request.get("rid")
        if tag is None:  # (told, not asked)
            return
        if raw is None:
            try:
                self._isend({"rid": rid, "reply": reply}, dest, tag)
            except Exception as exc:  # (a reply that cannot be pickled: the asker hears why)
                why = f"internal error: its reply could not be sent ({type(exc).__name__}: {exc})"
                self._isend({"rid": rid, "reply": {"error": why, "code": "INTERNAL"}}, dest, tag)
            return
        if request.get("data_tag") is not None:  # receives posted for sizes it told
            want = sizes_of(request.get("expect", []))
            fit = fitted(raw, want)
            if fit is None:
                error = f"holds {sum(r.nbytes for r in raw)} bytes of the fetch, not the "
                error += f"{sum(want)} asked for"
                self._isend({"rid": rid, "reply": {"error": error, "code": "INTERNAL"}}, dest, tag)
            else:
                sent = [self.comm.Isend(r, dest=dest, tag=request["data_tag"]) for r in fit]
                self._sends.append((sent, fit))
            return
        sizes = [r.nbytes for r in raw]
        self._isend({"rid": rid, "ok": sum(sizes), "runs": sizes}, dest, tag)
        self._sends.append(([self.comm.Isend(r, dest=dest, tag=tag) for r in raw], raw))

    def close(self, *, stop_all: bool) -> None:
        """Stop answering; ``stop_all``: tell the other services to stop too (one MPI job
        lives and ends together)."""
        if stop_all:
            self.tell_all({"kind": "shutdown", "node": self.node})
        self._pool.shutdown(wait=True)  # replies being made are handed over first
        with self._ask_lock:  # a request handed over, or refused: none left in between
            self._stop.set()
        self._wake.set()
        self._thread.join()
        with self._ask_lock:
            self.comm.Free()
        self.stats.close()


def _answered(answer: Callable[[dict], Any], request: dict) -> Any:
    """``answer(request)``, or the error reply of what it raised."""
    try:
        return answer(request)
    except ServiceError as exc:
        return {"error": str(exc), "code": exc.code}
    except Exception as exc:  # a peer's bad request must not kill this service
        return {"error": f"internal error: {type(exc).__name__}", "code": "INTERNAL"}


class _Unposted(Exception):
    """Receives could not all be posted: ``posted``, those that were."""

    def __init__(self, posted: list[Any]) -> None:
        super().__init__("a receive could not be posted")
        self.posted = posted


def _late_tag(call: _Call) -> str:
    """Which of ``call``'s tags its late bytes come on: "data" (posted with its request) or
    "reply" (told its sizes by an envelope)."""
    return "reply" if call.data_tag is None else "data"


def _envelope_in(msg: Any) -> dict | None:
    """The reply envelope ``msg`` (probed on a reply tag) holds; ``None``, the message taken
    off the queue, where it is none (late bytes are received aside by their size, so none
    should come here: a message that does must not end the link's thread)."""
    try:
        env = msg.recv()
    except Exception:  # (not a pickle: must not end the link's thread)
        return None
    return env if isinstance(env, dict) and "rid" in env else None


def _raw(reply: Any) -> list[np.ndarray] | None:
    """The raw messages ``reply`` is sent as (:class:`Pieces`' runs, straight from the store;
    an array's bytes); ``None``: it is pickled."""
    if isinstance(reply, Pieces):
        return reply.runs()
    if isinstance(reply, np.ndarray):
        return [np.ascontiguousarray(reply).reshape(-1).view(np.uint8)]
    return None


def _thread_multiple() -> bool:
    """Whether MPI lets any thread make MPI calls at any time (``MPI_THREAD_MULTIPLE``)."""
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


@dataclass(eq=False)
class _Call:
    """One request in flight: its reply's envelope, then (a fetch) its raw bytes into ``out``."""

    dest: int
    tag: int
    rid: int
    what: str
    out: list[np.ndarray] | None
    deadline: float
    reply: Any = None
    error: ServiceError | None = None
    recvs: list[Any] | None = None  # the receives of the raw bytes, once posted
    sizes: list[int] = field(default_factory=list)  # the raw bytes' messages
    unpack: list[tuple[Box, np.ndarray]] = field(default_factory=list)  # (target, aside)
    asked: float = field(default_factory=time.monotonic)
    enveloped: float = 0.0  # when its envelope came (a fetch; posted with it: when asked)
    data_tag: int | None = None  # its receives posted with the request: the tag its bytes use
    runs: list[tuple[int, int, int]] = field(default_factory=list)  # where they land in ``out``
    let_go: float = 0.0  # its receives cancelled: when it is over even if one has not ended
    late: bool = False  # (cancelled) the owner may still send its bytes
    done: threading.Event = field(default_factory=threading.Event)
    freed: threading.Event = field(default_factory=threading.Event)  # none lands in ``out``

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.out or [])

    def over(self, lent: bool = False) -> None:
        """The call is over; ``lent``: a receive may still land in its buffers (freed once
        the link saw it end)."""
        if not lent:
            self.freed.set()
        self.done.set()


@dataclass(eq=False)
class _Drain:
    """Late bytes of ``call`` (a fetch that gave up) received aside: ``recvs`` into ``aside``."""

    call: _Call
    recvs: list[Any]
    aside: list[np.ndarray]

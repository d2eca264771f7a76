"""The ``datastore.v1.DataStore`` servicer: the calls of ``datastore serve`` over the resident
datasets of one node.

``OpenSession`` validates a request and opens a session (:mod:`datastore.service.session`);
``StreamBatches`` streams a rank's batches, their tensors in shared memory or inline in the
message (:mod:`datastore.service.stream`); ``CloseSession`` frees the session. The stream is a
generator pulled by gRPC, so a slow client never makes the server buffer more than the stream's
``prefetch`` batches; a client that cancels or dies stops production. ``Shutdown`` (like a
signal) sets the process's :class:`Stop`.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from datastore._version import __version__
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.calls import CallCounter
from datastore.service.config import MAX_GRACE_S, ServeConfig
from datastore.service.errors import ServiceError
from datastore.service.grpc_peers import GrpcPeers
from datastore.service.logs import JsonLog
from datastore.service.mpi_peers import MpiPeers
from datastore.service.paths import shown
from datastore.service.peer_link import Peers, node_path
from datastore.service.resident import (
    FAILURES,
    Residency,
    Resident,
    listing,
    resolve_dataset,
)
from datastore.service.session import Sessions
from datastore.service.shm import remove_own
from datastore.service.stage_job import landed, stream_stage
from datastore.service.stream import Stream
from datastore.store.gather import Gather
from staging.exitcodes import Exit

__all__ = ["Counters", "Servicer", "Stop"]


class Stop:
    """Why and when to stop: set by a signal handler or by the ``Shutdown`` call."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.why = ""
        self.grace_s: float | None = None

    def request(self, why: str, grace_s: float | None = None) -> None:
        if not self.event.is_set():
            self.why, self.grace_s = why, grace_s
            self.event.set()


class Counters:
    """The calls (received, and those standing for a client now) and what the streams sent."""

    def __init__(self) -> None:
        self.calls = CallCounter()
        self.lock = threading.Lock()
        self.batches = 0
        self.bytes = 0


def residency_events(log: JsonLog) -> Callable[..., None]:
    """``on_event`` for the residency: its :data:`FAILURES` (a dataset that could not be
    loaded or reloaded, a state file unusable) as warnings, the rest as information."""

    def event(name: str, **fields: Any) -> None:
        (log.warning if name in FAILURES else log.info)(name, **fields)

    return event


def _abort_call(context: grpc.ServicerContext, exc: ServiceError) -> None:
    """End ``context``'s call now with ``exc``'s status, from any thread, even while its handler
    waits for the client to take a message (gRPC's ``abort`` works only in the handler's own
    thread, ``cancel`` says ``CANCELLED``; without gRPC's call object, it cancels)."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is None:
        context.cancel()
    else:
        call.cancel(getattr(grpc.StatusCode, exc.code).value[0], str(exc))


def _returns_slots(requests: Any, stream: Stream) -> None:
    """Read the client's later messages, returning the slots they list (a thread per stream)."""
    try:
        for r in requests:
            if r.mapped:
                stream.ring.client_mapped()
            stream.ring.done(list(r.done))
    except (grpc.RpcError, ValueError):
        pass  # the call ended: the stream stops through its callback


class Servicer(pb_grpc.DataStoreServicer):
    """``datastore.v1.DataStore`` over the resident datasets of one node."""

    def __init__(
        self,
        *,
        config: ServeConfig,
        listen: list[str],
        stop: Stop,
        counters: Counters,
        log: JsonLog,
        comm: Any = None,
        peers: GrpcPeers | None = None,
    ) -> None:
        self._started = time.monotonic()
        self._config = config
        self._listen = listen
        self._stop = stop
        self._counters = counters
        self._log = log
        self._streaming: dict[Stream, grpc.ServicerContext] = {}  # calls in their handlers
        self.link: Peers | None = peers
        if comm is not None:  # --peer-timeout bounds every wait on an MPI peer too
            self.link = MpiPeers(
                comm, self.answer, timeout_s=config.peer_timeout_s, at_once=self.answer_at_once
            )
        self.residency = Residency(
            config.memory_budget,
            config.state_file,
            on_event=residency_events(log),
            link=self.link,
            roots=config.allowed_roots,
        )
        self.sessions = Sessions(
            self.residency,
            config.allowed_roots,
            config.session_idle_s,
            on_event=log.info,
            gather=Gather(),  # copies spread over the node's cores, shared by every stream
        )

    def answer(self, request: dict) -> Any:
        """A peer service's request (``datastore.service.mpi_peers``)."""
        kind = request["kind"]
        if kind == "shutdown":
            self._stop.request(f"node {request['node']} stopped")
            return None
        if kind == "job_failed":
            return self.job_failed(request["job"], request["why"])
        if self._stop.event.is_set():  # nothing loaded or sent while this service stops
            raise ServiceError(
                "UNAVAILABLE", f"node {self.residency.node} is stopping ({self._stop.why})"
            )
        path = self._resolve(request["path"])
        if kind == "describe":  # (a peer about to read it: a stale copy here is forgotten)
            self.residency.check_local(path, request["path"])
            return listing(path, self._config.allowed_roots)
        if kind == "fetch":
            if not request.get("pieces"):
                raise ServiceError(
                    "FAILED_PRECONDITION",
                    f"node {self.residency.node} sends a block's parts inside the volume only, "
                    "asked for whole boxes by an older datastore: every service of a store "
                    "needs the same version",
                )
            # not evicted while answered; compared with its files when the asker's session
            # opened (Describe), never from inside a fetch
            r = self.residency.acquire(path, request["path"], check=False)
            try:
                return r.pieces(*_asked(request))
            except (ValueError, OSError) as exc:  # a sample that cannot be read
                raise ServiceError("DATA_LOSS", str(exc)) from None
            finally:
                self.residency.release(r)  # (the reply's views keep what it sends alive)
        raise ServiceError("INVALID_ARGUMENT", f"unknown peer request {kind!r}")

    def answer_at_once(self, request: dict) -> Any:
        """A peer's fetch of samples in RAM here (:meth:`answer`'s reply: views, no read, no
        file system call); ``None`` for any other request, answered by :meth:`answer`."""
        if request["kind"] != "fetch" or not request.get("pieces") or self._stop.event.is_set():
            return None  # (answer refuses it while this service stops)
        r = self.residency.acquire_named(request["path"])
        if r is None:
            return None
        try:
            return r.pieces_in_ram(*_asked(request))
        finally:
            self.residency.release(r)

    def internal_error(self, exc: BaseException) -> None:
        """Log an unexpected exception of a call in full; its caller gets only ``INTERNAL``."""
        self._log.error("internal_error", msg=f"{type(exc).__name__}: {exc}")

    def _resolve(self, path: str) -> str:
        """The real path of the dataset a client or peer named (``{node}``: this node)."""
        return resolve_dataset(node_path(path, self.residency.node), self._config.allowed_roots)

    def _refuse(self, context: grpc.ServicerContext, call: str, exc: ServiceError) -> None:
        self._log.warning("refused", call=call, code=exc.code, msg=str(exc))
        context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    def OpenSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            s = self.sessions.open(request)
        except ServiceError as exc:
            self._refuse(context, "OpenSession", exc)
        self._log.info(
            "session_opened",
            session=s.session_id,
            dataset=s.resident.path,
            job_id=request.job_id,
            world=s.world,
            global_batch=request.global_batch,
        )
        return pb.OpenSessionResponse(
            session_id=s.session_id,
            num_samples=s.resident.num_samples,
            steps_per_epoch=s.schedule.steps_per_epoch,
            fields=s.field_infos(),
            shuffle=s.schedule.shuffle,
            dataset_identity=s.resident.identity,
        )

    def _shared_memory(self, request: Any, context: grpc.ServicerContext) -> bool:
        local = context.peer().startswith("unix:")
        if request.transport == pb.TRANSPORT_SHARED_MEMORY and not local:
            raise ServiceError(
                "FAILED_PRECONDITION",
                "shared memory is served over the Unix socket only (the client is on this node)",
            )
        return request.transport == pb.TRANSPORT_SHARED_MEMORY or (
            request.transport == pb.TRANSPORT_UNSPECIFIED and local
        )

    def StreamBatches(self, requests: Any, context: grpc.ServicerContext) -> Any:
        try:
            request = next(requests, None)
        except grpc.RpcError:  # cancelled before its first request: nobody to answer
            return
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "StreamBatches needs a first request")
        try:
            session = self.sessions.get(request.session_id)
            shm = self._shared_memory(request, context)
            stream, shm = self._stream(session, request, shm)
        except ServiceError as exc:
            self._refuse(context, "StreamBatches", exc)
        context.add_callback(lambda: session.release(stream))
        self._streaming[stream] = context
        if shm and request.mapped:  # mapped during an earlier stream (one it may have left)
            stream.ring.client_mapped()
        if shm:
            threading.Thread(
                target=_returns_slots, args=(requests, stream), daemon=True, name="datastore-acks"
            ).start()
        try:
            for batch, nbytes, first in stream.messages():
                session.served(nbytes, first)
                with self._counters.lock:
                    self._counters.batches += int(first)
                    self._counters.bytes += nbytes
                yield batch
        except ServiceError as exc:
            if stream.failed:
                self._fail_job(session, stream, exc)
            if context.is_active():  # else the client went away: nobody to tell
                self._refuse(context, "StreamBatches", exc)
        except (ValueError, OSError) as exc:  # a sample that cannot be read
            lost = ServiceError("DATA_LOSS", str(exc))
            self._fail_job(session, stream, lost)
            self._refuse(context, "StreamBatches", lost)
        finally:
            self._streaming.pop(stream, None)
            session.release(stream)

    def _fail_job(self, session: Any, stream: Stream, exc: ServiceError) -> None:
        """``stream`` of ``session`` failed with ``exc``: every stream of its job, here and on
        the other nodes, ends ``ABORTED`` naming the rank and the cause (the job's other ranks
        streamed on, to hang in their next collective)."""
        why = (
            f"rank {stream.rank} of job {shown(session.request.job_id)} failed on node "
            f"{self.residency.node}: {exc.code}: {exc}"
        )
        self.job_failed(session.job, why)
        if self.link is not None:
            self.link.tell_all({"kind": "job_failed", "job": session.job, "why": why})

    def job_failed(self, job: str, why: str) -> int:
        """End every stream of ``job`` here (but those that failed themselves) with
        ``ABORTED`` giving ``why``, and refuse its sessions' new streams; how many ended."""
        ended = [(s, st) for s, st in self.sessions.fail_job(job, why) if not st.failed]
        for _, st in ended:
            st.close(why)
            context = self._streaming.get(st)
            if context is not None:  # (ended now, even if held in gRPC's flow control)
                _abort_call(context, st.cut())
        if ended:
            self._log.warning("job_failed", sessions=len({s.session_id for s, _ in ended}), msg=why)
        return len(ended)

    def _stream(self, session: Any, request: Any, shm: bool) -> tuple[Any, bool]:
        """``session``'s stream for ``request``, and whether over shared memory: a client
        that left the transport to the service (``TRANSPORT_UNSPECIFIED``) whose ring does not
        fit under the memory budget is streamed inline, the service saying so once per
        session (asked for, shared memory is refused ``RESOURCE_EXHAUSTED``)."""
        try:
            return session.stream(request, shm), shm
        except ServiceError as exc:
            auto = request.transport == pb.TRANSPORT_UNSPECIFIED
            if not (shm and auto and exc.code == "RESOURCE_EXHAUSTED"):
                raise
            if not session.inline_told:
                session.inline_told = True
                self._log.warning(
                    "streaming_inline",
                    session=session.session_id,
                    msg=f"{exc}: streaming inline instead (a larger --memory-budget keeps "
                    "shared memory)",
                )
            return session.stream(request, False), False

    def streaming(self) -> int:
        """The ``StreamBatches`` calls in their handlers now."""
        return len(self._streaming)

    def idle(self) -> bool:
        """Whether no call that a stop waits for is in flight (no stream, nothing standing for
        a client: a ``Stage``, a ``LoadDataset`` that waits)."""
        return not self._streaming and self._counters.calls.in_flight == 0

    def abort_streams(self) -> None:
        """End the streams still in their handlers, their sessions closed, with ``ABORTED``: a
        client that reads no more holds its handler in gRPC's flow control, where it cannot
        say so, and gRPC's end of the grace told it ``UNAVAILABLE`` ('Cancelling all calls')."""
        for stream, context in list(self._streaming.items()):
            exc = stream.cut()
            self._log.warning("refused", call="StreamBatches", code=exc.code, msg=str(exc))
            _abort_call(context, exc)

    def CloseSession(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            self.sessions.close(request.session_id)
        except ServiceError as exc:
            self._refuse(context, "CloseSession", exc)
        self._log.info("session_closed", session=request.session_id)
        return pb.CloseSessionResponse()

    def LoadDataset(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            r = self.residency.load(self._resolve(request.dataset_path), request.dataset_path)
        except ServiceError as exc:
            self._refuse(context, "LoadDataset", exc)
        if request.wait:
            while not r.wait(0.5):
                if not context.is_active():
                    break
        try:
            r.check_loaded()
        except ServiceError as exc:
            self._refuse(context, "LoadDataset", exc)
        return pb.LoadDatasetResponse(dataset=_dataset_status(r))

    def UnloadDataset(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            freed = self.residency.unload(self._resolve(request.dataset_path))
        except ServiceError as exc:
            self._refuse(context, "UnloadDataset", exc)
        return pb.UnloadDatasetResponse(bytes_freed=freed)

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.status()

    def status(self) -> Any:
        """The ``StatusResponse``: what ``datastore status`` shows and the metrics read."""
        with self._counters.lock:
            batches, nbytes = self._counters.batches, self._counters.bytes
        calls = self._counters.calls
        sessions = self.sessions.all()
        datasets = self.residency.all()
        return pb.StatusResponse(
            version=__version__,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self._started,
            listen=self._listen,
            datasets=[_dataset_status(r) for r in datasets],
            sessions=[
                pb.SessionStatus(
                    session_id=x.session_id,
                    dataset_path=x.resident.path,
                    job_id=x.request.job_id,
                    world_size=x.world,
                    global_batch=x.request.global_batch,
                    clients=len(x.streams),
                    batches_served=x.batches_served,
                    bytes_served=x.bytes_served,
                    opened_unix_s=x.opened_unix_s,
                    streams=len(x.streams),
                    stall_s=x.stall_s,
                    idle_s=x.idle_s(),
                )
                for x in sessions
            ],
            clients=len(sessions) + calls.in_flight,  # see datastore.service.calls
            batches_served=batches,
            bytes_served=nbytes,
            calls_served=calls.served,
            memory_budget=self._config.memory_budget or 0,
            bytes_resident=self.residency.bytes_resident,
            bytes_exchanged=self.link.bytes_received if self.link else 0,
            node=self.residency.node,
            nodes=self.link.nodes if self.link else 1,
        )

    def Stage(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._log.info("stage_started", sources=list(request.sources), dest=request.dest)
        last, refused = None, False
        stages = stream_stage(request, context.is_active, self._config.allowed_roots)
        try:
            for last in stages:
                if last.done and last.exit_code == Exit.OK and request.load:
                    last = self._load_landed(request, last)
                yield last
        except ServiceError as exc:
            refused = True
            self._refuse(context, "Stage", exc)
        finally:  # also when gRPC drops this stream, the client gone while a reply was sent
            stages.close()  # (the stage killed now, not whenever the stream is collected)
            if last is not None and last.done:
                self._log.info("stage_done", dest=request.dest, exit_code=last.exit_code)
            elif not refused:  # (a refusal is logged as one)
                self._log.warning("stage_cancelled", dest=request.dest)

    def _load_landed(self, request: Any, done: Any) -> Any:
        """Make what a stage put in DEST resident (:func:`landed`): every dataset among those
        paths is loaded; ``done``, the stage's last message, or for a path that is not a
        dataset a copy saying so (the files are staged all the same) with exit code 2."""
        failed = []
        for path in landed(request.sources, request.dest):
            try:
                self.residency.load(resolve_dataset(path, self._config.allowed_roots))
            except ServiceError as exc:
                failed.append(f"{path}: {exc.code}: {exc}")
        if not failed:
            return done
        self._log.warning("stage_not_loaded", dest=request.dest, errors=failed)
        out = type(done)()
        out.CopyFrom(done)
        out.exit_code = Exit.BAD_INPUT
        out.message = (
            f"staged, but not made resident (--load): {'; '.join(failed)}; load the dataset "
            "directories inside with `datastore load PATH`, or stage them as sources"
        )
        return out

    def Shutdown(self, request: Any, context: grpc.ServicerContext) -> Any:
        g = request.grace_s
        if not (math.isfinite(g) and 0 <= g <= MAX_GRACE_S):
            self._refuse(
                context, "Shutdown",
                ServiceError("INVALID_ARGUMENT", f"grace_s must be 0..{MAX_GRACE_S:g} s, got {g}"),
            )  # fmt: skip
        grace = g if g > 0 else None
        self._log.info(
            "shutdown_requested", peer=context.peer(), reason=request.reason, grace_s=grace
        )
        self._stop.request("Shutdown", grace)
        return pb.ShutdownResponse(accepted=True)

    def restore(self) -> None:
        """Reload the datasets the state file lists (in the background), logging which."""
        reloading = self.residency.restore()
        if reloading:
            self._log.info("reloading", datasets=reloading)

    def close(self) -> None:
        if self.link is not None:
            by_peer = self._stop.why.startswith("node ")
            self.link.close(stop_all=bool(self._stop.why) and not by_peer)
        self.sessions.close_all()
        self.residency.close()
        leaked = remove_own()
        if leaked:  # a defect of ours, not the user's: say so in the log
            self._log.warning("segments_removed", count=len(leaked), paths=[str(p) for p in leaked])


def _dataset_status(r: Resident) -> Any:
    return pb.DatasetStatus(
        path=r.path,
        format=str(getattr(r.reader, "format", "")),
        num_samples=r.num_samples,
        bytes_total=r.nbytes,
        bytes_resident=r.store.filled_bytes(),
        sessions=r.sessions,
        loading=r.loading,
        last_used_unix_s=r.last_used,
        hits=r.store.counters.hits,
        misses=r.store.counters.misses,
        local_samples=len(r.store.keys),
        load_error=r.load_error,
        bytes_read=r.store.counters.bytes_read,
    )


def _asked(request: dict) -> tuple:
    """A peer's fetch as :meth:`~datastore.service.resident.Resident.pieces` takes it."""
    index = request.get("index", b"")
    return request["samples"], request["fields"], request["spatial"], request["block"], index

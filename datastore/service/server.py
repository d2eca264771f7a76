"""The ``datastore serve`` process: a gRPC server on a private Unix socket (and optional TCP).

What runs: the ``datastore.v1.DataStore`` servicer, standard health checking
(``grpc.health.v1``) and server reflection, on a Unix socket claimed through
:mod:`datastore.service.paths`; with ``tcp`` also on a TCP address whose every call must carry
the shared secret (:mod:`datastore.service.auth`). SIGTERM, SIGINT and the ``Shutdown`` call
stop accepting calls, drain those in flight (up to ``grace_s``), remove the socket (and its
directory if this server created it) and return 0.

Data path: ``OpenSession`` validates a request and opens a session
(:mod:`datastore.service.session`); ``StreamBatches`` streams a rank's batches, their tensors in
shared memory or inline in the message (:mod:`datastore.service.stream`); ``CloseSession`` frees
the session. Replies up to ``MAX_MESSAGE`` (256 MiB) are allowed (gRPC's default is 4 MiB); an
inline batch larger than the chunk size (64 MiB, ``DATASTORE_INLINE_CHUNK``) is sent as several
messages (``Batch.chunk``); requests over ``MAX_REQUEST`` (4 MiB) end with
``RESOURCE_EXHAUSTED`` before any handler reads them. The stream is a generator pulled by gRPC,
so a slow client never makes the server buffer more than the stream's ``prefetch`` batches; a
client that cancels or dies stops production.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from datastore._version import __version__
from datastore.delivery import Gather
from datastore.service import SERVICE_NAME
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.auth import TokenInterceptor, read_token
from datastore.service.calls import CallCounter
from datastore.service.errors import ServiceError
from datastore.service.grpc_peers import GrpcPeers, PeersServicer, add_peers_to_server
from datastore.service.guard import GuardInterceptor
from datastore.service.logs import JsonLog
from datastore.service.metrics import serve_metrics
from datastore.service.paths import AddressInUse, UnsafeDirectory, claim_socket, unix_target
from datastore.service.peers import MpiPeers, Peers, node_path
from datastore.service.resident import Residency, Resident, listing, resolve_dataset
from datastore.service.session import Sessions, spatial_of
from datastore.service.shm import reclaim_stale
from datastore.service.stage_job import landed, stream_stage
from datastore.service.stream import Stream, chunk_bytes
from datastore.service.wire import MAX_MESSAGE, keep_large_blocks, serialize
from staging.exitcodes import Exit
from staging.launcher import LaunchMismatch, comm_world

__all__ = ["ServeConfig", "Servicer", "serve"]

MAX_REQUEST = 4 * 1024 * 1024  # requests are small: a larger one is refused, never read
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_REQUEST),
]


MAX_GRACE_S = 3600.0
"""The longest drain ``--grace`` or ``Shutdown(grace_s)`` may ask for."""


@dataclass(frozen=True)
class ServeConfig:
    """What ``datastore serve`` was asked for.

    Args:
        socket: the Unix socket path.
        private: ``socket`` is the default path, whose directory must be private.
        tcp: ``HOST:PORT`` to listen on as well (port 0: any free port). Default: none.
        token_file: the shared secret for ``tcp``; required with it. Default: none.
        tls_cert, tls_key: PEM certificate chain and private key: TCP is served over TLS.
            Default: none (plaintext TCP, the token in the clear: trusted networks only).
        grace_s: seconds to let calls in flight finish on shutdown. Default: ``5.0``.
        workers: threads serving calls. Default: ``16``.
        memory_budget: bytes of memory for resident datasets. Default: none (no limit).
        state_file: where the resident datasets are listed, to reload them after a restart.
            Default: none.
        allowed_roots: datasets (and stage paths) must lie under one of these. Default: any.
        session_idle_s: close a session that has had no stream for this long. Default: ``600``.
        metrics: ``HOST:PORT`` to serve Prometheus ``/metrics`` on. Default: none.
        peers: every service's TCP ``HOST:PORT`` when the services of a store peer over gRPC
            (:mod:`datastore.service.grpc_peers`), in node order. Default: none.
        node: this service's index in ``peers``. Default: none.
        peer_ca: PEM certificate(s) to check the peers' TLS against. Default: ``tls_cert``.
        peer_timeout_s: how long a request to a peer may wait. Default: ``60``.
    """

    socket: Path
    private: bool = False
    tcp: str | None = None
    token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    grace_s: float = 5.0
    workers: int = 16
    memory_budget: int | None = None
    state_file: Path | None = None
    allowed_roots: tuple[Path, ...] = ()
    session_idle_s: float = 600.0
    metrics: str | None = None
    peers: tuple[str, ...] = ()
    node: int | None = None
    peer_ca: Path | None = None
    peer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tcp is not None and self.token_file is None:
            raise ValueError("--tcp needs --token-file: TCP is never served without a secret")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_cert is not None and self.tcp is None:
            raise ValueError("--tls-cert is for --tcp (the Unix socket needs no TLS)")
        if self.tcp is not None and ":" not in self.tcp:
            raise ValueError(f"--tcp wants HOST:PORT, got {self.tcp!r}")
        if not (math.isfinite(self.grace_s) and 0 <= self.grace_s <= MAX_GRACE_S):
            raise ValueError(f"--grace must be 0..{MAX_GRACE_S:g} seconds, got {self.grace_s}")
        if self.workers < 1:
            raise ValueError("--workers must be >= 1")
        if self.memory_budget is not None and self.memory_budget < 0:
            raise ValueError("the memory budget must be >= 0")
        if self.session_idle_s <= 0:
            raise ValueError("the session idle time must be > 0")
        if self.metrics is not None and ":" not in self.metrics:
            raise ValueError(f"--metrics wants HOST:PORT, got {self.metrics!r}")
        if self.peers and (self.tcp is None or self.node is None):
            raise ValueError("--peers needs --tcp (peers call each other there) and --node")
        if self.node is not None and not self.peers:
            raise ValueError("--node goes with --peers")
        if self.node is not None and not 0 <= self.node < len(self.peers):
            raise ValueError(f"--node {self.node} is not an index of the {len(self.peers)} --peers")
        if self.peer_ca is not None and self.tls_cert is None:
            raise ValueError("--peer-ca is for TLS (--tls-cert)")
        if self.peer_timeout_s <= 0:
            raise ValueError("the peer timeout must be > 0")
        for r in self.allowed_roots:
            if not os.path.exists(r):
                raise ValueError(f"--allow {r}: no such directory")
        roots = tuple(Path(os.path.realpath(r)) for r in self.allowed_roots)
        object.__setattr__(self, "allowed_roots", roots)
        state = self.state_file
        if state is not None and state.is_dir():
            raise ValueError(f"--state-file {state} is a directory: name a file in one")
        if state is not None and state.parent.exists() and not state.parent.is_dir():
            raise ValueError(f"--state-file {state}: {state.parent} is not a directory")


class _Counters:
    """The calls (received, and those standing for a client now) and what the streams sent."""

    def __init__(self) -> None:
        self.calls = CallCounter()
        self.lock = threading.Lock()
        self.batches = 0
        self.bytes = 0


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
        stop: _Stop,
        counters: _Counters,
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
        self.link: Peers | None = MpiPeers(comm, self.answer) if comm is not None else peers
        self.residency = Residency(
            config.memory_budget,
            config.state_file,
            on_event=log.info,
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
        """A peer service's request (``datastore.service.peers``)."""
        kind = request["kind"]
        if kind == "shutdown":
            self._stop.request(f"node {request['node']} stopped")
            return None
        path = self._resolve(request["path"])
        if kind == "describe":
            return listing(path, self._config.allowed_roots)
        if kind == "fetch":
            r = self.residency.load(path, request["path"])
            return r.blocks(
                request["samples"], request["fields"], request["spatial"], request["block"]
            )
        raise ServiceError("INVALID_ARGUMENT", f"unknown peer request {kind!r}")

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
        request = next(requests, None)
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "StreamBatches needs a first request")
        try:
            session = self.sessions.get(request.session_id)
            shm = self._shared_memory(request, context)
            stream = session.stream(request, shm)
        except ServiceError as exc:
            self._refuse(context, "StreamBatches", exc)
        context.add_callback(lambda: session.release(stream))
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
            if context.is_active():  # else the client went away: nobody to tell
                self._refuse(context, "StreamBatches", exc)
        except (ValueError, OSError) as exc:  # a sample that cannot be read
            self._refuse(context, "StreamBatches", ServiceError("DATA_LOSS", str(exc)))
        finally:
            session.release(stream)

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
            bytes_resident=sum(r.budgeted for r in datasets),
            bytes_exchanged=self.link.bytes_received if self.link else 0,
            node=self.residency.node,
            nodes=self.link.nodes if self.link else 1,
        )

    def Stage(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._log.info("stage_started", sources=list(request.sources), dest=request.dest)
        last = None
        try:
            for last in stream_stage(request, context.is_active, self._config.allowed_roots):
                if last.done and last.exit_code == Exit.OK and request.load:
                    self._load_landed(request)
                yield last
        except ServiceError as exc:
            self._refuse(context, "Stage", exc)
        if last is not None and last.done:
            self._log.info("stage_done", dest=request.dest, exit_code=last.exit_code)
        else:
            self._log.warning("stage_cancelled", dest=request.dest)

    def _load_landed(self, request: Any) -> None:
        """Make what a stage put in DEST resident (:func:`landed`): every dataset among those
        paths is loaded; the first that is not one then fails the call, naming it."""
        failed = None
        for path in landed(request.sources, request.dest):
            try:
                self.residency.load(resolve_dataset(path, self._config.allowed_roots))
            except ServiceError as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

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

    def close(self) -> None:
        if self.link is not None:
            by_peer = self._stop.why.startswith("node ")
            self.link.close(stop_all=bool(self._stop.why) and not by_peer)
        self.sessions.close_all()
        self.residency.close()


def _restore(servicer: Servicer, log: JsonLog) -> None:
    reloading = servicer.residency.restore()
    if reloading:
        log.info("reloading", datasets=reloading)


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
    )


class _Stop:
    """Why and when to stop: set by a signal handler or by the ``Shutdown`` call."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.why = ""
        self.grace_s: float | None = None

    def request(self, why: str, grace_s: float | None = None) -> None:
        if not self.event.is_set():
            self.why, self.grace_s = why, grace_s
            self.event.set()


def _new_server(workers: int, interceptors: list[grpc.ServerInterceptor]) -> grpc.Server:
    # so_reuseport off: a second server must never share a TCP port with a live one
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="datastore-rpc"),
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0), *MESSAGE_OPTIONS],
    )


class _Handlers:
    """Catches the generated code's method handlers, to be adjusted before registering."""

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def _add_datastore(servicer: Servicer, server: grpc.Server) -> None:
    """The generated registration, but ``StreamBatches`` responses may be framed bytes
    (``datastore.service.wire``): inline payloads are copied once, not four times."""
    caught = _Handlers()
    pb_grpc.add_DataStoreServicer_to_server(servicer, caught)
    caught.handlers["StreamBatches"] = grpc.stream_stream_rpc_method_handler(
        servicer.StreamBatches,
        request_deserializer=pb.StreamBatchesRequest.FromString,
        response_serializer=serialize,
    )
    generic = grpc.method_handlers_generic_handler(caught.service, caught.handlers)
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(caught.service, caught.handlers)


def _add_services(
    server: grpc.Server,
    servicer: Servicer,
    health_servicer: health.HealthServicer,
    *,
    peers: bool,
) -> None:
    """Register the services on ``server``; ``peers``: also ``datastore.v1.Peers`` when this
    service peers over gRPC (on TCP, where the peers call)."""
    _add_datastore(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [
        pb.DESCRIPTOR.services_by_name["DataStore"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    link = servicer.link
    if peers and isinstance(link, GrpcPeers):
        answering = PeersServicer(
            link.node, link.nodes, servicer.answer, spatial_of, servicer.internal_error
        )
        add_peers_to_server(answering, server)
        names.append(pb.DESCRIPTOR.services_by_name["Peers"].full_name)
    reflection.enable_server_reflection(names, server)


def serve(config: ServeConfig, *, log: JsonLog | None = None, out: Any = None) -> int:
    """Run the service until SIGTERM, SIGINT or ``Shutdown``; returns the exit code.

    Args:
        config: what to serve where.
        log: where structured logs go. Default: JSON lines on stderr.
        out: where the listening addresses are printed for people and scripts.
            Default: ``sys.stdout``.
    """
    log = log or JsonLog()
    out = out or sys.stdout
    keep_large_blocks()  # inline batches: a message of tens of MiB per step, in the heap
    try:
        comm = _services_comm()
    except LaunchMismatch as exc:
        log.error("launch_mismatch", msg=str(exc))
        return Exit.BAD_INPUT
    if comm is not None and config.peers:
        log.error(
            "bad_usage",
            msg="--peers is for services that are not one MPI job: under mpiexec the services "
            "of a store peer over MPI",
        )
        return Exit.BAD_INPUT
    if comm is not None:  # one service per rank: {rank} tells their sockets apart on one host
        rank = str(comm.Get_rank())
        state = config.state_file
        config = dataclasses.replace(
            config,
            socket=Path(str(config.socket).replace("{rank}", rank)),
            state_file=Path(str(state).replace("{rank}", rank)) if state else None,
        )
    return _serve(config, log, out, comm)


def _services_comm() -> Any:
    """``COMM_WORLD`` when several services were launched together by MPI, else ``None``."""
    from staging.cluster import launched_by_mpi

    if not launched_by_mpi():
        return None
    comm = comm_world()
    return comm if comm.Get_size() > 1 else None


def _all_started(comm: Any, ok: bool, log: JsonLog) -> bool:
    """Whether every service started (collective, once, at start-up)."""
    if comm is None:
        return ok
    every = comm.allgather(ok)
    if ok and not all(every):
        failed = [n for n, good in enumerate(every) if not good]
        log.error("peer_failed_to_start", nodes=failed, msg="the store needs every node")
    return all(every)


def _serve(config: ServeConfig, log: JsonLog, out: Any, comm: Any) -> int:
    try:
        chunk_bytes()  # read by every inline stream: a bad value stops the service now
    except ValueError as exc:
        log.error("bad_usage", msg=str(exc))
        _all_started(comm, False, log)
        return Exit.BAD_INPUT
    token = None
    if config.tcp is not None:
        assert config.token_file is not None  # checked by ServeConfig
        try:
            token, loose = read_token(config.token_file)
        except (OSError, ValueError) as exc:
            log.error("bad_token_file", msg=f"cannot use token file: {exc}")
            _all_started(comm, False, log)
            return Exit.BAD_INPUT
        if loose:  # anyone who can read the secret could use the service
            log.error(
                "token_file_readable_by_others",
                path=str(config.token_file),
                msg=f"token file {config.token_file} is readable by others: chmod 600 it",
            )
            _all_started(comm, False, log)
            return Exit.BAD_INPUT
    try:
        claim = claim_socket(config.socket, private=config.private)
    except (AddressInUse, UnsafeDirectory, ValueError, OSError) as exc:  # OSError: no such dir
        log.error("cannot_listen", socket=str(config.socket), msg=str(exc))
        _all_started(comm, False, log)
        return Exit.FAILED
    if not _all_started(comm, True, log):
        claim.release()
        return Exit.FAILED
    if claim.removed_stale:
        log.warning(
            "removed_stale_socket",
            socket=str(claim.socket),
            msg="a socket left by a server that died; nothing answered on it",
        )
    try:
        return _run(config, claim, token, log, out, comm)
    finally:
        claim.release()


def _run(
    config: ServeConfig, claim: Any, token: str | None, log: JsonLog, out: Any, comm: Any
) -> int:
    stop = _Stop()
    counters = _Counters()
    listen = [unix_target(claim.socket)]
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    removed = reclaim_stale()
    if removed:
        log.warning(
            "removed_stale_segments",
            count=len(removed),
            msg="shared memory left by a service that died",
        )
    peers = None
    if config.peers:
        assert token is not None and config.node is not None  # checked by ServeConfig
        try:
            peers = GrpcPeers(
                config.peers,
                config.node,
                token,
                config.peer_ca or config.tls_cert,
                config.peer_timeout_s,
            )
        except OSError as exc:
            log.error("bad_tls_files", msg=f"cannot read the peers' CA: {exc}")
            return Exit.BAD_INPUT
    servicer = Servicer(
        config=config, listen=listen, stop=stop, counters=counters, log=log, comm=comm, peers=peers
    )
    metrics_server = None

    guard = GuardInterceptor(servicer.internal_error)
    servers = [_new_server(config.workers, [counters.calls, guard])]
    old_umask = os.umask(0o177)  # the socket is born 0600
    try:
        servers[0].add_insecure_port(listen[0])
    finally:
        os.umask(old_umask)
    if config.tcp is not None:
        assert token is not None
        denied = TokenInterceptor(
            token, on_denied=lambda method: log.warning("unauthenticated", method=method)
        )
        tcp_server = _new_server(config.workers, [counters.calls, denied, guard])
        try:
            if config.tls_cert is not None:
                assert config.tls_key is not None
                pair = (config.tls_key.read_bytes(), config.tls_cert.read_bytes())
                port = tcp_server.add_secure_port(config.tcp, grpc.ssl_server_credentials([pair]))
            else:
                port = tcp_server.add_insecure_port(config.tcp)
        except OSError as exc:
            log.error("bad_tls_files", msg=f"cannot read the TLS files: {exc}")
            return Exit.BAD_INPUT
        except RuntimeError as exc:
            log.error("cannot_listen", tcp=config.tcp, msg=f"cannot bind {config.tcp}: {exc}")
            return Exit.FAILED
        host = config.tcp.rsplit(":", 1)[0]
        listen.append(f"{host}:{port}")
        servers.append(tcp_server)
    for server in servers:
        _add_services(server, servicer, health_servicer, peers=server is not servers[0])

    def on_signal(signum: int, _frame: Any) -> None:
        stop.request(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for server in servers:
            server.start()
        os.chmod(claim.socket, 0o600)
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "listening",
            listen=listen,
            pid=os.getpid(),
            version=__version__,
            grpc=grpc.__version__,
            socket=str(claim.socket),
            private_dir=config.private,
            created_dir=str(claim.created_dir) if claim.created_dir else None,
            token_file=str(config.token_file) if config.token_file else None,
            grace_s=config.grace_s,
            workers=config.workers,
            node=servicer.residency.node,
            peers=list(config.peers) or None,
        )
        if config.metrics is not None:
            try:
                metrics_server, port = serve_metrics(config.metrics, servicer.status)
            except (OSError, ValueError) as exc:
                log.error("cannot_listen", metrics=config.metrics, msg=str(exc))
                return Exit.FAILED
            host = config.metrics.rsplit(":", 1)[0] or "127.0.0.1"
            listen.append(f"http://{host}:{port}/metrics")
        if isinstance(servicer.link, GrpcPeers):  # a peer may be down: never hold up the start
            threading.Thread(target=_restore, args=(servicer, log), daemon=True).start()
        else:
            _restore(servicer, log)
        for address in listen:
            print(f"datastore serve: listening on {address}", file=out, flush=True)
        while not stop.event.wait(0.5):
            pass
        grace = config.grace_s if stop.grace_s is None else stop.grace_s
        log.info("draining", why=stop.why, grace_s=grace)
        health_servicer.enter_graceful_shutdown()
        t0 = time.monotonic()
        stopping = [server.stop(grace) for server in servers]
        for done in stopping:  # calls in flight get the grace...
            done.wait(max(0.0, t0 + grace + 1 - time.monotonic()))
        servicer.sessions.close_all()  # ...then open streams end (ABORTED) and handlers return
        for done in stopping:
            done.wait(5)
        log.info(
            "stopped",
            why=stop.why,
            drain_s=round(time.monotonic() - t0, 3),
            calls_served=counters.calls.served,
        )
        return Exit.OK
    finally:
        for server in servers:
            server.stop(None)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if metrics_server is not None:
            metrics_server.shutdown()
        servicer.close()

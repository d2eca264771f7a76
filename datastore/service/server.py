"""The ``datastore serve`` process: start-up, signals, drain and exit around the gRPC servers.

What runs: the ``datastore.v1.DataStore`` servicer (:mod:`datastore.service.servicer`), standard
health checking (``grpc.health.v1``) and server reflection (:mod:`datastore.service.listeners`),
on a Unix socket claimed through :mod:`datastore.service.paths`; with ``tcp`` also on a TCP
address whose every call must carry the shared secret (:mod:`datastore.service.auth`). Under
``mpiexec`` one service a rank, the services of one store; every service checks its start-up
(token file, socket) and they start only if all can. SIGTERM, SIGINT and the ``Shutdown`` call
stop accepting calls, drain those in flight (up to ``grace_s``), remove the socket (and its
directory if this server created it) and return 0.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from datastore._version import __version__
from datastore.service import SERVICE_NAME
from datastore.service.auth import TokenInterceptor, read_token
from datastore.service.calls import Refusing
from datastore.service.config import ServeConfig
from datastore.service.grpc_peers import GrpcPeers
from datastore.service.guard import GuardInterceptor
from datastore.service.listeners import add_services, bind_data, bind_tcp, bind_unix, new_server
from datastore.service.logs import JsonLog
from datastore.service.metrics import serve_metrics
from datastore.service.paths import AddressInUse, UnsafeDirectory, claim_socket, unix_target
from datastore.service.servicer import Counters, Servicer, Stop
from datastore.service.shm import disk_backed, reclaim_stale, segment_dir
from datastore.service.stream import chunk_bytes
from datastore.service.wire import keep_large_blocks
from staging.exitcodes import Agreed, Exit
from staging.launcher import LaunchMismatch, comm_world

__all__ = ["serve"]

ABORT_BEFORE_S = 1.0  # open streams end (ABORTED) this long before gRPC cancels them


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
        return Agreed(Exit.BAD_INPUT)  # (each process in a world of its own)
    if comm is not None and config.peers:
        log.error(
            "bad_usage",
            msg="--peers is for services that are not one MPI job: under mpiexec the services "
            "of a store peer over MPI",
        )
        return Agreed(Exit.BAD_INPUT)  # (every rank has the same arguments)
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
        segment_dir()  # the same for every shared-memory stream
    except ValueError as exc:
        log.error("bad_usage", msg=str(exc))
        _all_started(comm, False, log)
        return Agreed(Exit.BAD_INPUT)
    token = None
    if config.tcp is not None:
        assert config.token_file is not None  # checked by ServeConfig
        try:
            token, loose = read_token(config.token_file)
        except (OSError, ValueError) as exc:
            log.error("bad_token_file", msg=f"cannot use token file: {exc}")
            _all_started(comm, False, log)
            return Agreed(Exit.BAD_INPUT)
        if loose:  # anyone who can read the secret could use the service
            log.error(
                "token_file_readable_by_others",
                path=str(config.token_file),
                msg=f"token file {config.token_file} is readable by others: chmod 600 it",
            )
            _all_started(comm, False, log)
            return Agreed(Exit.BAD_INPUT)
    try:
        claim = claim_socket(config.socket, private=config.private)
    except (AddressInUse, UnsafeDirectory, ValueError, OSError) as exc:  # OSError: no such dir
        log.error("cannot_listen", socket=str(config.socket), msg=str(exc))
        _all_started(comm, False, log)
        return Agreed(Exit.FAILED)
    if not _all_started(comm, True, log):
        claim.release()
        return Agreed(Exit.FAILED)
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
    stop = Stop()
    counters = Counters()
    listen = [unix_target(claim.socket)]
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    slow = disk_backed(segment_dir())
    if slow is not None:
        log.warning("segments_on_disk", msg=slow)
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
                on_event=log.warning,
            )
        except OSError as exc:
            log.error("bad_tls_files", msg=f"cannot read the peers' CA: {exc}")
            return Exit.BAD_INPUT
    servicer = Servicer(
        config=config, listen=listen, stop=stop, counters=counters, log=log, comm=comm, peers=peers
    )
    metrics_server = None

    guard = GuardInterceptor(servicer.internal_error)
    refusing = Refusing(stop.event.is_set)
    servers = [new_server(config.workers, [counters.calls, refusing, guard])]
    bind_unix(servers[0], listen[0])
    if config.tcp is not None:
        assert token is not None
        denied = TokenInterceptor(
            token, on_denied=lambda method: log.warning("unauthenticated", method=method)
        )
        tcp_server = new_server(config.workers, [counters.calls, denied, refusing, guard])
        try:
            listen.append(bind_tcp(tcp_server, config.tcp, config.tls_cert, config.tls_key))
        except OSError as exc:
            log.error("bad_tls_files", msg=f"cannot read the TLS files: {exc}")
            return Exit.BAD_INPUT
        except RuntimeError as exc:
            log.error("cannot_listen", tcp=config.tcp, msg=f"cannot bind {config.tcp}: {exc}")
            return Exit.FAILED
        servers.append(tcp_server)
    data = None
    if config.peers:
        assert config.tcp is not None  # checked by ServeConfig
        try:
            data = bind_data(
                config.tcp, config.data_port, config.tls_cert, config.tls_key, config.peer_timeout_s
            )
        except OSError as exc:
            log.error("cannot_listen", data_port=config.data_port, msg=f"data listener: {exc}")
            return Exit.FAILED
    for server in servers:
        add_services(server, servicer, health_servicer, peers=server is not servers[0], data=data)

    def on_signal(signum: int, _frame: Any) -> None:
        stop.request(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for server in servers:
            server.start()
        os.chmod(claim.socket, 0o600)
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        if config.metrics is not None:
            try:
                metrics_server, port = serve_metrics(config.metrics, servicer.status)
            except (OSError, ValueError) as exc:
                log.error(
                    "cannot_listen",
                    metrics=config.metrics,
                    msg=f"--metrics {config.metrics}: cannot listen: {exc}",
                )
                return Exit.FAILED
            host = config.metrics.rsplit(":", 1)[0] or "127.0.0.1"
            listen.append(f"http://{host}:{port}/metrics")
        open_paths = _tcp_without_allow(config)  # (once it listens: a failed start says one line)
        if open_paths is not None:
            log.warning("tcp_without_allow", msg=open_paths)
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
            data_port=data.port if data is not None else None,
        )
        if isinstance(servicer.link, GrpcPeers):  # a peer may be down: never hold up the start
            threading.Thread(target=servicer.restore, daemon=True).start()
        else:
            servicer.restore()
        for address in listen:
            print(f"datastore serve: listening on {address}", file=out, flush=True)
        while not stop.event.wait(0.5):
            pass
        grace = config.grace_s if stop.grace_s is None else stop.grace_s
        log.info("draining", why=stop.why, grace_s=grace)
        t0 = time.monotonic()
        _drain(servers, servicer, health_servicer, grace)
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
        if data is not None:
            data.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if metrics_server is not None:
            metrics_server.shutdown()
        servicer.close()


def _tcp_without_allow(config: ServeConfig) -> str | None:
    """The warning for a service on TCP that confines no path (no ``--allow``), else ``None``:
    there it said nothing of what a token opens."""
    if config.tcp is None or config.allowed_roots:
        return None
    return (
        f"--tcp {config.tcp} without --allow: any client with the token may read every dataset "
        "and stage any tree this user can read, to any place it can write; confine them with "
        "--allow DIR"
    )


def _drain(
    servers: list[grpc.Server],
    servicer: Servicer,
    health_servicer: health.HealthServicer,
    grace: float,
) -> None:
    """Take no new work (``calls.Refusing``), give the calls in flight ``grace`` seconds, end
    the open streams (``ABORTED``, naming the cause) and only then stop the servers, waiting
    a little for their handlers to return. A stream whose client reads no more waits in gRPC's
    flow control, where its handler cannot answer: it is ended from here
    (``Servicer.abort_streams``), before gRPC's GOAWAY, after which its status was lost with
    its connection; gRPC's own end of the grace told such a client ``UNAVAILABLE``
    ("Cancelling all calls")."""
    health_servicer.enter_graceful_shutdown()
    _until(servicer.idle, grace - ABORT_BEFORE_S)  # calls in flight get the grace...
    servicer.sessions.close_all()  # ...then open streams end (ABORTED) and handlers return
    _until(lambda: not servicer.streaming(), ABORT_BEFORE_S / 2)
    servicer.abort_streams()  # those whose client reads no more
    stopping = [server.stop(ABORT_BEFORE_S / 2) for server in servers]
    for done in stopping:
        done.wait(ABORT_BEFORE_S + 5)


def _until(done: Any, seconds: float) -> None:
    """Wait until ``done()`` or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)

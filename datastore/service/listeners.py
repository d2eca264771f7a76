"""The gRPC servers of ``datastore serve``: built, bound to the Unix socket and TCP, and the
services registered on them (``datastore.v1.DataStore``, health checking, reflection, and
``datastore.v1.Peers`` on TCP when the services peer over gRPC, and beside it their data
listener, :mod:`datastore.service.data_link`).

Replies up to ``MAX_MESSAGE`` (256 MiB) are allowed (gRPC's default is 4 MiB); an inline batch
larger than the chunk size (64 MiB, ``DATASTORE_INLINE_CHUNK``) is sent as several messages
(``Batch.chunk``); requests over ``MAX_REQUEST`` (4 MiB) end with ``RESOURCE_EXHAUSTED`` before
any handler reads them.
"""

from __future__ import annotations

import os
import socket
import ssl
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.data_link import DataListener
from datastore.service.grpc_answer import PeersServicer, add_peers_to_server
from datastore.service.grpc_peers import GrpcPeers
from datastore.service.servicer import Servicer
from datastore.service.session import spatial_of
from datastore.service.wire import MAX_MESSAGE, serialize

__all__ = ["MAX_REQUEST", "add_services", "bind_data", "bind_tcp", "bind_unix", "new_server"]

MAX_REQUEST = 4 * 1024 * 1024  # requests are small: a larger one is refused, never read
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_REQUEST),
]


def new_server(workers: int, interceptors: list[grpc.ServerInterceptor]) -> grpc.Server:
    """A server of ``workers`` threads, each call (a stream for its whole life) holding one: a
    call beyond them is ``RESOURCE_EXHAUSTED`` at once (it waited for a stream to end: a job
    of 17 ranks on 16 threads hung at its first step)."""
    # so_reuseport off: a second server must never share a TCP port with a live one
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="datastore-rpc"),
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0), *MESSAGE_OPTIONS],
        maximum_concurrent_rpcs=workers,
    )


def bind_unix(server: grpc.Server, target: str) -> None:
    """Listen on the Unix socket ``target``, the socket born 0600."""
    old_umask = os.umask(0o177)
    try:
        server.add_insecure_port(target)
    finally:
        os.umask(old_umask)


def bind_tcp(server: grpc.Server, tcp: str, tls_cert: Path | None, tls_key: Path | None) -> str:
    """Listen on ``tcp`` (``HOST:PORT``), over TLS with a certificate; the address listened on
    (port 0 becomes the port given).

    Raises:
        OSError: a TLS file cannot be read.
        RuntimeError: the address cannot be bound.
    """
    credentials = None
    if tls_cert is not None:
        assert tls_key is not None  # checked by ServeConfig
        _check_pair(tls_cert, tls_key)
        pair = (tls_key.read_bytes(), tls_cert.read_bytes())
        credentials = grpc.ssl_server_credentials([pair])
    _check_bindable(tcp)
    if credentials is not None:
        port = server.add_secure_port(tcp, credentials)
    else:
        port = server.add_insecure_port(tcp)
    return f"{tcp.rsplit(':', 1)[0]}:{port}"


def _check_pair(cert: Path, key: Path) -> None:
    """Raise ``OSError`` unless ``cert`` is a PEM certificate and ``key`` its private key
    (gRPC would print C-core lines and fail as if the port could not be bound)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise OSError(
            f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its private "
            f"key ({exc.reason or exc})"
        ) from None


def _check_bindable(tcp: str) -> None:
    """Raise ``RuntimeError`` saying why no address of ``tcp`` can be bound (a port in use,
    an address not this host's) before gRPC tries: it would print a C-core error line on
    stderr (whatever ``GRPC_VERBOSITY`` says) and raise without the reason. Like gRPC, one
    address of the host's that binds is enough. A host that does not resolve is named."""
    host, _, port = tcp.rpartition(":")
    try:
        found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise RuntimeError(f"host {host!r} does not resolve ({exc.strerror})") from None
    except (OSError, ValueError):
        return
    if port == "0":  # any free port
        return
    why = None
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as gRPC binds)
            try:
                s.bind(address)
            except OSError as exc:
                why = why or exc.strerror or str(exc)
                continue
        return
    if why is not None:
        raise RuntimeError(why)


def bind_data(
    tcp: str, port: int, tls_cert: Path | None, tls_key: Path | None, timeout_s: float
) -> DataListener:
    """The peers' data listener on the host of ``tcp``, at ``port`` (0: any free port), over
    TLS with the same certificate as ``tcp``.

    Raises:
        OSError: a TLS file cannot be read, or the port cannot be bound.
    """
    tls = None
    if tls_cert is not None:
        assert tls_key is not None  # checked by ServeConfig
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(tls_cert, tls_key)
        tls.num_tickets = 0  # no resumption: nothing unasked on an idle connection
    return DataListener(tcp.rsplit(":", 1)[0], port, tls, timeout_s)


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


def add_services(
    server: grpc.Server,
    servicer: Servicer,
    health_servicer: health.HealthServicer,
    *,
    peers: bool,
    data: DataListener | None = None,
) -> None:
    """Register the services on ``server``; ``peers``: also ``datastore.v1.Peers`` when this
    service peers over gRPC (on TCP, where the peers call), its data listener ``data``
    answering the fetches there."""
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
            link.node,
            link.nodes,
            servicer.answer,
            spatial_of,
            servicer.internal_error,
            data,
            at_once=servicer.answer_at_once,
        )
        add_peers_to_server(answering, server)
        if data is not None:
            data.start(answering.serve_data)
        names.append(pb.DESCRIPTOR.services_by_name["Peers"].full_name)
    reflection.enable_server_reflection(names, server)

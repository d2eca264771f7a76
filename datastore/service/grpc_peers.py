"""Services forming one store without a shared MPI job: the peer link over gRPC.

``datastore serve --tcp HOST:PORT --token-file F --peers A0,A1,... --node K`` on each node: the
same ``--peers`` list (every service's TCP address, in node order) everywhere, and each
service its own index ``K`` in it. A service asks its peers through the ``datastore.v1.Peers``
service on their TCP addresses, with the store's shared token (and TLS when it is on), what
:class:`~datastore.service.peers.MpiPeers` asks over MPI: which files of a sharded dataset they
hold (``Describe``), and the blocks its local ranks need of the samples they own
(``FetchBlocks``, streamed in chunks of at most :data:`CHUNK` bytes, so that a block of any
size fits gRPC's message limits). As over MPI, the owner sends each box's part inside the
volume straight from its store (``pieces``: nothing packed there), and the asker writes the
chunks straight into the batch slot, a part amid its halo included (one copy; the asker zeroes
the halo outside the volume).

The services are independent processes: one that stops does not stop the others. Every call
waits for a peer that is not up yet (a store starting, or a peer restarting) up to
``timeout_s``, then fails with ``UNAVAILABLE`` naming the node, and the asking service keeps
serving; once the peer is back, the next call reaches it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from datastore.maths.subarray import view
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.auth import bearer
from datastore.service.errors import ServiceError
from datastore.service.peers import (
    STATS_ENV,
    Box,
    ExchangeStats,
    Listing,
    Pending,
    Pieces,
    Segments,
    targets,
)
from datastore.service.wire import bytes_field, bytes_field_view, keep_large_blocks

__all__ = ["CHUNK", "GrpcPeers", "PeersServicer", "add_peers_to_server", "parse_peers"]

SERVICE = "datastore.v1.Peers"
CHUNK = 4 * 1024 * 1024
FETCH_THREADS = 8  # fetches in flight at once (a stream's next steps, every owner)
_DATA = 1  # FetchBlocksResponse.data
_OPTIONS = [
    ("grpc.max_receive_message_length", 2 * CHUNK),
    # a restarted peer is retried within a second, not after gRPC's backoff of up to 2 min
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def parse_peers(text: str) -> tuple[str, ...]:
    """``"h0:p0,h1:p1,..."`` as addresses; a clear ``ValueError`` for a malformed one."""
    peers = tuple(a.strip() for a in text.split(","))
    for a in peers:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--peers wants HOST:PORT,HOST:PORT,..., got {a!r} in {text!r}")
    if len(set(peers)) != len(peers):
        raise ValueError(f"--peers names an address twice: {text!r}")
    return peers


# -- the chunks of a FetchBlocks reply, framed by hand: one copy on each side ----------------
def frame_chunk(chunk: np.ndarray) -> bytes:
    """A ``FetchBlocksResponse`` whose ``data`` is ``chunk``'s bytes."""
    return bytes_field(_DATA, chunk)


def chunk_view(raw: bytes) -> memoryview:
    """The ``data`` of a serialized ``FetchBlocksResponse``, without copying it."""
    return bytes_field_view(raw, _DATA)


def _layout(spatial: dict[str, Any] | None) -> Any:
    if not spatial:
        return pb.SpatialLayout()
    return pb.SpatialLayout(
        parts=spatial["parts"],
        halo=spatial.get("halo", ()),
        boundary=spatial.get("boundary", ""),
    )


# -- asking ------------------------------------------------------------------------------------
class GrpcPeers:
    """Requests to the other services of a store named by their TCP addresses.

    Args:
        addresses: every service's ``HOST:PORT``, in node order, this one's included.
        node: this service's index in ``addresses``.
        token: the store's shared secret (every service's ``--token-file``).
        tls_ca: PEM certificate(s) to check the peers' TLS against. Default: plaintext.
        timeout_s: how long a call waits for a peer (its start included). Default: ``60``.
    """

    def __init__(
        self,
        addresses: tuple[str, ...],
        node: int,
        token: str,
        tls_ca: Path | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if not 0 <= node < len(addresses):
            raise ValueError(f"--node {node} is not an index of the {len(addresses)} --peers")
        self.addresses, self.node, self.nodes = addresses, node, len(addresses)
        self.timeout_s = timeout_s
        self.bytes_received = 0
        self.sends_pieces = True  # the parts inside the volume, straight from the store
        self.receives_boxes = True  # a part amid its halo is written in place, not aside
        self._metadata = bearer(token)
        self._credentials = None
        if tls_ca is not None:
            self._credentials = grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._pool: ThreadPoolExecutor | None = None  # fetches in flight at once
        self.stats = ExchangeStats(os.environ.get(STATS_ENV, ""), node)
        keep_large_blocks()  # the peers' messages: freed buffers reused, not mapped afresh

    def _channel(self, dest: int) -> grpc.Channel:
        with self._lock:
            if dest not in self._channels:
                target = self.addresses[dest]
                if self._credentials is None:
                    ch = grpc.insecure_channel(target, options=_OPTIONS)
                else:
                    ch = grpc.secure_channel(target, self._credentials, options=_OPTIONS)
                self._channels[dest] = ch
            return self._channels[dest]

    def _header(self, dest: int) -> Any:
        return pb.PeerHeader(from_node=self.node, to_node=dest, nodes=self.nodes)

    def _failed(self, dest: int, what: str, exc: grpc.RpcError) -> ServiceError:
        at = f"node {dest} ({self.addresses[dest]})"
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return ServiceError(
                "UNAVAILABLE", f"{at} did not answer {what} within {self.timeout_s:g} s"
            )
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return ServiceError(
                "FAILED_PRECONDITION",
                f"{at} refused this node's token: every service of a store needs the same "
                "--token-file",
            )
        return ServiceError(code.name, f"{at}: {exc.details()}")

    def describe(self, dest: int, path: str) -> Listing:
        """Node ``dest``'s listing of the dataset clients call ``path``."""
        call = self._channel(dest).unary_unary(
            f"/{SERVICE}/Describe",
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.DescribeResponse.FromString,
        )
        request = pb.DescribeRequest(header=self._header(dest), dataset_path=path)
        try:
            r = call(request, timeout=self.timeout_s, metadata=self._metadata, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise self._failed(dest, "Describe", exc) from None
        signature = {f.name: (f.dtype, tuple(f.shape)) for f in r.fields}
        return r.shardable, list(r.files), signature

    def start(self, dest: int, request: dict, out: Segments) -> Pending:
        """:meth:`fetch` on a thread of the link's pool; returns at once."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="datastore-grpc")
            future = self._pool.submit(self.fetch, dest, request, out)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        return Pending(done, future.result)

    def fetch(self, dest: int, request: dict, out: Segments) -> None:
        """Node ``dest``'s packed blocks of ``request["samples"]`` into ``out`` (uint8
        arrays, strided ones included, filled one after the other in C order), each chunk
        copied once, straight into place."""
        call = self._channel(dest).unary_stream(
            f"/{SERVICE}/FetchBlocks",
            request_serializer=pb.FetchBlocksRequest.SerializeToString,
            response_deserializer=chunk_view,
        )
        message = pb.FetchBlocksRequest(
            header=self._header(dest),
            dataset_path=request["path"],
            samples=request["samples"],
            fields=request["fields"],
            spatial=_layout(request["spatial"]),
            block=request["block"],
            pieces=bool(request.get("pieces")),
        )
        into, sizes = _Filler([_as_bytes(t) for t in targets(out)]), []
        self.stats.begin()
        asked, first = time.monotonic(), None  # the legs: asked -> first chunk -> last byte
        try:
            for chunk in call(
                message, timeout=self.timeout_s, metadata=self._metadata, wait_for_ready=True
            ):
                if first is None:
                    first = time.monotonic()
                if not into.put(np.frombuffer(chunk, np.uint8)):
                    raise ServiceError(
                        "INTERNAL", f"node {dest} sent more than the {into.nbytes} bytes asked"
                    )
                sizes.append(len(chunk))
        except grpc.RpcError as exc:
            raise self._failed(dest, "FetchBlocks", exc) from None
        finally:
            whole = into.at == into.nbytes and first is not None
            legs = (first - asked, time.monotonic() - first) if whole else (0.0, 0.0)
            self.stats.end(into.at if whole else 0, sizes, legs)
        if into.at != into.nbytes:
            raise ServiceError("INTERNAL", f"node {dest} sent {into.at} of {into.nbytes} bytes")
        self.bytes_received += into.at

    def close(self, *, stop_all: bool) -> None:
        """Close the channels; the peers are independent services and keep running."""
        del stop_all
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        self.stats.close()


class _Filler:
    """Bytes written one after the other into several uint8 arrays (each in C order)."""

    def __init__(self, out: list[np.ndarray]) -> None:
        self.out, self.nbytes, self.at = out, sum(b.nbytes for b in out), 0
        self._k, self._in = 0, 0  # the array written now, and where in it

    def put(self, data: np.ndarray) -> bool:
        """Write ``data`` next; ``False`` (nothing written) if it does not fit."""
        if self.at + data.nbytes > self.nbytes:
            return False
        done = 0
        while done < data.nbytes:
            buf = self.out[self._k]
            n = min(buf.nbytes - self._in, data.nbytes - done)
            put_flat(buf, self._in, data[done : done + n])
            done, self._in = done + n, self._in + n
            if self._in == buf.nbytes:
                self._k, self._in = self._k + 1, 0
        self.at += done
        return True


def _as_bytes(target: np.ndarray | Box) -> np.ndarray:
    """A fetch's target as uint8: a :data:`Box` part strided, its last axis its bytes."""
    return view(*target).view(np.uint8) if isinstance(target, tuple) else target


def put_flat(out: np.ndarray, start: int, data: np.ndarray) -> None:
    """Write the 1-d ``data`` at ``start`` of ``out``'s elements in C order (``out`` may be
    strided): a partial row, whole rows at once, a partial row, down the axes; a few numpy
    copies whatever the size."""
    if out.ndim <= 1:
        out.reshape(-1)[start : start + data.size] = data
        return
    row = out[0].size
    i, at = divmod(start, row)
    done = 0
    if at:
        done = min(row - at, data.size)
        put_flat(out[i], at, data[:done])
        i += 1
    whole = (data.size - done) // row
    if whole:
        out[i : i + whole] = data[done : done + whole * row].reshape(whole, *out.shape[1:])
        done, i = done + whole * row, i + whole
    if done < data.size:
        put_flat(out[i], 0, data[done:])


# -- answering ---------------------------------------------------------------------------------
class PeersServicer:
    """``datastore.v1.Peers``: a peer's requests, answered by ``answer`` (the servicer's).

    Args:
        node, nodes: this service's index and the store's size.
        answer: ``answer(request) -> reply`` as :class:`~datastore.service.peers.MpiPeers`
            takes it (``{"kind": "describe" | "fetch", ...}``).
        spatial_of: a ``SpatialLayout`` as the dict ``answer`` takes.
        on_error: told of an unexpected exception (logged there; the peer gets ``INTERNAL``
            without Python's text). Default: nothing.
    """

    def __init__(
        self,
        node: int,
        nodes: int,
        answer: Callable[[dict], Any],
        spatial_of: Callable[[Any], dict[str, Any] | None],
        on_error: Callable[[BaseException], None] = lambda exc: None,
    ) -> None:
        self.node, self.nodes = node, nodes
        self._answer, self._spatial_of, self._on_error = answer, spatial_of, on_error

    def _check(self, header: Any, context: grpc.ServicerContext) -> None:
        if (header.to_node, header.nodes) != (self.node, self.nodes):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this service is node {self.node} of {self.nodes}, asked as node "
                f"{header.to_node} of {header.nodes}: every service needs the same --peers "
                "and its own --node",
            )

    def _call(self, request: dict, context: grpc.ServicerContext) -> Any:
        try:
            return self._answer(request)
        except ServiceError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except Exception as exc:  # a peer's bad request must not kill this service
            self._on_error(exc)
            context.abort(grpc.StatusCode.INTERNAL, "internal error (the service's log says why)")

    def Describe(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._check(request.header, context)
        ok, files, signature = self._call(
            {"kind": "describe", "path": request.dataset_path}, context
        )
        fields = [
            pb.FieldSignature(name=n, dtype=dtype, shape=shape)
            for n, (dtype, shape) in signature.items()
        ]
        return pb.DescribeResponse(shardable=ok, files=files, fields=fields)

    def FetchBlocks(self, request: Any, context: grpc.ServicerContext) -> Iterator[np.ndarray]:
        self._check(request.header, context)
        asked = {
            "kind": "fetch",
            "path": request.dataset_path,
            "samples": [int(i) for i in request.samples],
            "fields": list(request.fields),
            "spatial": self._spatial_of(request.spatial),
            "block": request.block,
            "pieces": request.pieces,
        }
        reply = self._call(asked, context)
        if isinstance(reply, Pieces):  # straight from the store: nothing packed
            cut = reply.runs()
        else:
            cut = [np.ascontiguousarray(reply).reshape(-1).view(np.uint8)]
        for run in cut:
            for at in range(0, run.nbytes, CHUNK):
                yield run[at : at + CHUNK]


def add_peers_to_server(servicer: PeersServicer, server: grpc.Server) -> None:
    """Register ``datastore.v1.Peers``; ``FetchBlocks`` chunks are framed by hand."""
    handlers = {
        "Describe": grpc.unary_unary_rpc_method_handler(
            servicer.Describe,
            request_deserializer=pb.DescribeRequest.FromString,
            response_serializer=pb.DescribeResponse.SerializeToString,
        ),
        "FetchBlocks": grpc.unary_stream_rpc_method_handler(
            servicer.FetchBlocks,
            request_deserializer=pb.FetchBlocksRequest.FromString,
            response_serializer=frame_chunk,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

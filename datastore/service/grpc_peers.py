"""Services forming one store without a shared MPI job: the peer link over gRPC.

``datastore serve --tcp HOST:PORT --token-file F --peers A0,A1,... --node K`` on each node: the
same ``--peers`` list (every service's TCP address, in node order) everywhere, and each
service its own index ``K`` in it. A service asks its peers through the ``datastore.v1.Peers``
service on their TCP addresses, with the store's shared token (and TLS when it is on), what
:class:`~datastore.service.mpi_peers.MpiPeers` asks over MPI: which files of a sharded dataset they
hold (``Describe``), and the blocks its local ranks need of the samples they own
(``FetchBlocks``). The blocks travel over a data connection beside gRPC
(:mod:`datastore.service.data_link`: authorised by ``OpenData``, only the kernel copies the
bytes), or, where the owner's data port cannot be reached (a firewall open to the gRPC port
only), over the ``FetchBlocks`` stream (chunks of at most :data:`CHUNK` bytes, so that a block
of any size fits gRPC's message limits). As over MPI, the owner sends each box's part inside the
volume straight from its store (``pieces``: nothing packed there), and the asker writes the
bytes straight into the batch slot, a part amid its halo included (one copy), and zeroes the
halo outside the volume around it.

The services are independent processes: one that stops does not stop the others. Every call
waits for a peer that is not up yet (a store starting, or a peer restarting) up to
``timeout_s``, then fails with ``UNAVAILABLE`` naming the node, and the asking service keeps
serving; once the peer is back, the next call reaches it.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from datastore.maths.subarray import MIN_RUN, run_bytes, runs, view
from datastore.ranks.subarrays import ASIDE_KEPT, Asides
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.auth import bearer
from datastore.service.data_link import IDLE_S, DataConnection, PeerError, split_address
from datastore.service.errors import ServiceError
from datastore.service.peer_link import Box, Listing, Pending, Segments, targets, zero_rest
from datastore.service.peer_stats import STATS_ENV, ExchangeStats
from datastore.service.wire import bytes_field_view, keep_large_blocks

__all__ = ["CHUNK", "DATA_FIELD", "SERVICE", "GrpcPeers", "chunk_view", "parse_peers"]

SERVICE = "datastore.v1.Peers"
CHUNK = 4 * 1024 * 1024
FETCH_THREADS = 8  # fetches in flight at once (a stream's next steps, every owner)
CONNECT_S = 3.0  # a data port not reached within this (or the timeout) falls back to gRPC
RETRY_S = 60.0  # ...for this long; then the data connection is tried again
REUSE_S = IDLE_S / 2  # a data connection unused longer is closed, not reused (the owner
# closes one after IDLE_S: never while this side may still pick it)
DATA_FIELD = 1  # FetchBlocksResponse.data
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


# -- the chunks of a FetchBlocks reply (framed by hand by grpc_answer): read in place ---------
def chunk_view(raw: bytes) -> memoryview:
    """The ``data`` of a serialized ``FetchBlocksResponse``, without copying it."""
    return bytes_field_view(raw, DATA_FIELD)


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
        timeout_s: how long a call waits for a peer (its start included), and a data
            connection's every send or receive. Default: ``60``.
        on_event: ``on_event(event, **fields)``, told when a peer's data port cannot be
            reached (first, or again after it was): its fetches then go over gRPC for
            :data:`RETRY_S`, then the data connection is tried again. Default: nothing.
    """

    def __init__(
        self,
        addresses: tuple[str, ...],
        node: int,
        token: str,
        tls_ca: Path | None = None,
        timeout_s: float = 60.0,
        on_event: Callable[..., None] = lambda event, **fields: None,
    ) -> None:
        if not 0 <= node < len(addresses):
            raise ValueError(f"--node {node} is not an index of the {len(addresses)} --peers")
        self.addresses, self.node, self.nodes = addresses, node, len(addresses)
        self.timeout_s = timeout_s
        self.bytes_received = 0
        self._metadata = bearer(token)
        self._credentials, self._tls, self._ca = None, None, None
        if tls_ca is not None:
            ca = tls_ca.read_bytes()
            self._credentials = grpc.ssl_channel_credentials(root_certificates=ca)
            self._ca = ca.decode()
            self._tls = ssl.create_default_context(cadata=self._ca)
        self._on_event = on_event
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._idle: dict[int, list[DataConnection]] = {}  # data connections to reuse, by node
        self._busy: set[DataConnection] = set()  # data connections of fetches in flight
        self._telling: set[Any] = set()  # JobFailed calls in flight
        self._closed = False
        self._grpc_only: dict[int, float] = {}  # node -> when its data port was not reached
        self._pool: ThreadPoolExecutor | None = None  # fetches in flight at once
        self.stats = ExchangeStats(os.environ.get(STATS_ENV, ""), node)
        self._asides = Asides(ASIDE_KEPT)  # parts received aside, reused: no fresh pages
        keep_large_blocks()  # the peers' messages: freed buffers reused, not mapped afresh

    def _channel(self, dest: int) -> grpc.Channel:
        with self._lock:
            if self._closed:  # (a fetch queued before the close, run after it)
                raise self._stopping(dest)
            if dest not in self._channels:
                target = self.addresses[dest]
                if self._credentials is None:
                    ch = grpc.insecure_channel(target, options=_OPTIONS)
                else:
                    ch = grpc.secure_channel(target, self._credentials, options=_OPTIONS)
                self._channels[dest] = ch
            return self._channels[dest]

    def _stopping(self, dest: int) -> ServiceError:
        """A call asked after :meth:`close`: refused, never sent (a channel opened now would
        wait for a peer that may be gone, holding up this service's exit)."""
        at = f"node {dest} ({self.addresses[dest]})"
        return ServiceError("UNAVAILABLE", f"{at} was not asked: this service is stopping")

    def _header(self, dest: int) -> Any:
        return pb.PeerHeader(from_node=self.node, to_node=dest, nodes=self.nodes)

    def _failed(self, dest: int, what: str, exc: grpc.RpcError) -> ServiceError:
        at = f"node {dest} ({self.addresses[dest]})"
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            mismatch = self._tls_mismatch(dest)
            if mismatch is not None:
                return ServiceError("FAILED_PRECONDITION", f"{at}: {mismatch}")
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

    def _tls_mismatch(self, dest: int) -> str | None:
        """Why node ``dest`` cannot be talked to, where TLS is the reason (gRPC only retries a
        failed handshake until the call's deadline, and says the deadline passed): a handshake
        refused under this service's ``--peer-ca``, or a peer that talks TLS to one without.
        ``None`` where it is not TLS (a peer down, slow or unreachable)."""
        host, port = split_address(self.addresses[dest])
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # (gRPC's ALPN: not the data link's)
        if self._ca is None:  # does the peer answer a TLS handshake, whatever its certificate?
            tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
        else:
            tls.load_verify_locations(cadata=self._ca)
        tls.set_alpn_protocols(["h2"])
        try:
            with (
                socket.create_connection((host, port), timeout=CONNECT_S) as raw,
                tls.wrap_socket(raw, server_hostname=host),
            ):
                pass
        except ssl.SSLError as exc:
            if self._ca is None:
                return None  # (a plaintext peer)
            return (
                f"no TLS connection ({exc.reason or exc}): every service of a store needs a "
                "--tls-cert that the others' --peer-ca signed"
            )
        except OSError:  # (down, or no handshake within the time)
            return None
        if self._ca is None:
            return (
                "it talks TLS and this service does not: every service of a store needs "
                "--tls-cert and --tls-key, or none does"
            )
        return None

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

    def tell_all(self, request: dict) -> None:
        """Tell every other node that a job failed (``{"kind": "job_failed", "job", "why"}``),
        expecting no reply: the calls go on their own (a peer down is not waited for)."""
        for dest in range(self.nodes):
            if dest == self.node:
                continue
            try:
                channel = self._channel(dest)
            except ServiceError:
                return  # (this service is stopping)
            call = channel.unary_unary(
                f"/{SERVICE}/JobFailed",
                request_serializer=pb.JobFailedRequest.SerializeToString,
                response_deserializer=pb.JobFailedResponse.FromString,
            )
            told = pb.JobFailedRequest(
                header=self._header(dest), job=request["job"], why=request["why"]
            )
            future = call.future(told, timeout=self.timeout_s, metadata=self._metadata)
            with self._lock:  # (a call whose future is collected is cancelled)
                self._telling.add(future)
            future.add_done_callback(self._told)

    def _told(self, future: Any) -> None:
        with self._lock:
            self._telling.discard(future)

    def start(self, dest: int, request: dict, out: Segments) -> Pending:
        """:meth:`fetch` on a thread of the link's pool; returns at once. Its ``abandon``
        returns once no byte can land in ``out`` any more."""
        job = _Job()
        with self._lock:
            if self._closed:  # a new pool now would hold up the service's exit
                future: Future = Future()
                future.set_exception(self._stopping(dest))
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        FETCH_THREADS, thread_name_prefix="datastore-grpc"
                    )
                future = self._pool.submit(self._fetch, dest, request, out, job)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())

        def abandon() -> None:
            job.abandon()
            future.cancel()
            done.wait()  # bounded: every wait of a fetch has its timeout

        return Pending(done, future.result, abandon)

    def fetch(self, dest: int, request: dict, out: Segments) -> None:
        """Node ``dest``'s packed blocks of ``request["samples"]`` into ``out`` (uint8
        arrays, strided ones included, filled one after the other in C order), received
        straight into place."""
        self._fetch(dest, request, out, _Job())

    def _fetch(self, dest: int, request: dict, out: Segments, job: _Job) -> None:
        message = pb.FetchBlocksRequest(
            header=self._header(dest),
            dataset_path=request["path"],
            samples=request["samples"],
            fields=request["fields"],
            spatial=_layout(request["spatial"]),
            block=request["block"],
            pieces=bool(request.get("pieces")),
            index=request.get("index", b""),
        )
        parts = targets(out)
        conn = None if self._over_grpc(dest) else self._connection(dest, job)
        if conn is None:
            self._fetch_grpc(dest, message, parts, job)
        else:
            self._fetch_data(dest, message, parts, job, conn)

    def _connection(self, dest: int, job: _Job) -> DataConnection | None:
        """A quiet data connection to node ``dest`` (reused, or opened through ``OpenData``,
        which ``job``'s abandon cancels); ``None`` where its data port cannot be reached
        (logged; gRPC for the next :data:`RETRY_S`)."""
        while True:
            with self._lock:
                conn = self._idle.get(dest, []).pop() if self._idle.get(dest) else None
            if conn is None:
                break
            if conn.idle() and time.monotonic() - conn.quiet_since <= REUSE_S:
                return conn
            conn.close()  # the peer closed it (restarted?), or it sat unused: a new one
        call = self._channel(dest).unary_unary(
            f"/{SERVICE}/OpenData",
            request_serializer=pb.OpenDataRequest.SerializeToString,
            response_deserializer=pb.OpenDataResponse.FromString,
        )
        request = pb.OpenDataRequest(header=self._header(dest))
        opening = call.future(
            request, timeout=self.timeout_s, metadata=self._metadata, wait_for_ready=True
        )
        try:
            if not job.attach(opening.cancel):
                opening.cancel()
            r = opening.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            if job.abandoned:
                raise self._abandoned(dest) from None
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # a peer without a data port
                raise self._failed(dest, "OpenData", exc) from None
            return self._unreachable(dest, f"OpenData: {exc.details()}")
        finally:
            job.detach()
        host = self.addresses[dest].rpartition(":")[0]
        address = f"{host}:{r.port}"
        try:
            conn = DataConnection(
                address,
                r.ticket,
                tls=self._tls,
                connect_s=min(CONNECT_S, self.timeout_s),
                timeout_s=self.timeout_s,
            )
        except OSError as exc:
            return self._unreachable(dest, f"{address}: {exc}")
        with self._lock:
            self._grpc_only.pop(dest, None)  # reached (again): a later failure is told anew
        return conn

    def _abandoned(self, dest: int) -> ServiceError:
        return ServiceError(
            "CANCELLED", f"the fetch from node {dest} ({self.addresses[dest]}) was abandoned"
        )

    def _over_grpc(self, dest: int) -> bool:
        """Whether node ``dest``'s data port was found unreachable less than
        :data:`RETRY_S` ago (its fetches go over gRPC until then)."""
        with self._lock:
            since = self._grpc_only.get(dest)
        return since is not None and time.monotonic() - since < RETRY_S

    def _unreachable(self, dest: int, why: str) -> None:
        with self._lock:
            first = dest not in self._grpc_only
            self._grpc_only[dest] = time.monotonic()
        if first:
            self._on_event(
                "peer_data_port_unreachable",
                node=dest,
                msg=f"node {dest}'s data connection cannot be made ({why}): its blocks come "
                "over gRPC (slower; open the --data-port too)",
            )

    def _fetch_data(
        self,
        dest: int,
        message: Any,
        parts: list[np.ndarray | Box],
        job: _Job,
        conn: DataConnection,
    ) -> None:
        """One fetch over a data connection: received into each part's contiguous runs, or,
        where they are short (a part amid its halo, cut on the last axis), aside then copied
        in place (one numpy copy beats a Python view per run) and its box's halo zeroed."""
        buffers, aside, direct = [], [], []
        for p in parts:
            t = _as_bytes(p)
            if t.flags.c_contiguous or run_bytes(t) >= MIN_RUN:
                buffers += runs(t) if t.nbytes else []
                direct.append(p)
            else:
                aside.append((t, self._asides.take(t.nbytes), p))
                buffers.append(aside[-1][1])
        at, sizes, ok = f"node {dest} ({self.addresses[dest]})", [], False
        self.stats.begin()
        asked, first = time.monotonic(), 0.0
        try:
            with self._lock:
                stopping = self._closed
                self._busy.add(conn)
            if stopping:
                raise self._stopping(dest)
            if not job.attach(conn.stop):
                raise self._abandoned(dest)
            sizes, first = conn.fetch(message.SerializeToString(), buffers)
            for t, got, p in aside:
                t[...] = got.reshape(t.shape)
                zero_rest(p)
            for p in direct:
                zero_rest(p)
            ok = True
        except PeerError as exc:
            raise ServiceError(exc.code, f"{at}: {exc}") from None
        except (OSError, EOFError) as exc:
            if job.abandoned:
                raise self._abandoned(dest) from None
            if self._closed:
                why = "was not waited for: this service is stopping"
            elif isinstance(exc, TimeoutError):
                why = f"did not answer FetchBlocks within {self.timeout_s:g} s"
            else:
                why = f"broke off FetchBlocks ({exc or type(exc).__name__})"
            raise ServiceError("UNAVAILABLE", f"{at} {why}") from None
        finally:
            job.detach()
            for _, got, _ in aside:  # (the receive has returned: nothing writes there now)
                self._asides.give(got)
            total = sum(sizes) if ok else 0
            legs = (first - asked, time.monotonic() - first) if ok else (0.0, 0.0)
            self.stats.end(total, sizes, legs)
            now, stale = time.monotonic(), []
            with self._lock:
                self._busy.discard(conn)
                keep = ok and not self._closed
                if keep:
                    conn.quiet_since = now
                    pool = self._idle.setdefault(dest, [])
                    stale = [c for c in pool if now - c.quiet_since > REUSE_S]
                    pool[:] = [c for c in pool if c not in stale] + [conn]
            for c in stale if keep else [conn]:
                c.close()
        self.bytes_received += total

    def _fetch_grpc(
        self, dest: int, message: Any, parts: list[np.ndarray | Box], job: _Job
    ) -> None:
        """One fetch over the ``FetchBlocks`` stream: each chunk copied once, into place."""
        for p in parts:
            zero_rest(p)
        call = self._channel(dest).unary_stream(
            f"/{SERVICE}/FetchBlocks",
            request_serializer=pb.FetchBlocksRequest.SerializeToString,
            response_deserializer=chunk_view,
        )
        filler, sizes = _Filler([_as_bytes(p) for p in parts]), []
        self.stats.begin()
        asked, first = time.monotonic(), None  # the legs: asked -> first chunk -> last byte
        try:
            stream = call(
                message, timeout=self.timeout_s, metadata=self._metadata, wait_for_ready=True
            )
            if not job.attach(stream.cancel):
                stream.cancel()
            for chunk in stream:
                if first is None:
                    first = time.monotonic()
                if not filler.put(np.frombuffer(chunk, np.uint8)):
                    raise ServiceError(
                        "INTERNAL", f"node {dest} sent more than the {filler.nbytes} bytes asked"
                    )
                sizes.append(len(chunk))
        except grpc.RpcError as exc:
            raise self._failed(dest, "FetchBlocks", exc) from None
        finally:
            job.detach()
            whole = filler.at == filler.nbytes and first is not None
            legs = (first - asked, time.monotonic() - first) if whole else (0.0, 0.0)
            self.stats.end(filler.at if whole else 0, sizes, legs)
        if filler.at != filler.nbytes:
            raise ServiceError("INTERNAL", f"node {dest} sent {filler.at} of {filler.nbytes} bytes")
        self.bytes_received += filler.at

    def close(self, *, stop_all: bool) -> None:
        """Close the channels; the peers are independent services and keep running."""
        del stop_all
        with self._lock:
            self._closed = True
            busy = list(self._busy)
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
            pool, self._pool = self._pool, None
        for conn in idle:
            conn.close()
        for conn in busy:  # a fetch in flight ends now (its thread closes the connection)
            conn.stop()
        if pool is not None:
            pool.shutdown(wait=False)
        self.stats.close()


class _Job:
    """A fetch that may be abandoned: how to stop the transfer it is in, if any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.abandoned = False
        self._stop: Callable[[], Any] | None = None

    def attach(self, stop: Callable[[], Any]) -> bool:
        """``stop`` ends the transfer now under way; ``False`` if already abandoned."""
        with self._lock:
            self._stop = stop
            return not self.abandoned

    def detach(self) -> None:
        with self._lock:
            self._stop = None

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            if self._stop is not None:
                self._stop()


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

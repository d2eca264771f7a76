"""Channels to ``datastore serve``, the calls the CLI makes, and the batch stream a loader reads.

``DataStoreLoader(..., service=ServiceOptions(address=...))`` draws its batches through
:class:`RemoteBatches` (``datastore.sources.service``); gRPC errors reach users as
``datastore.errors`` types (:func:`raise_for`).
"""

from __future__ import annotations

import math
import os
import queue
import ssl
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from datastore.errors import DatasetNotFound, DataStoreError, PathNotAllowed, ServiceUnavailable
from datastore.readers.base import FieldInfo
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.auth import bearer
from datastore.service.paths import unix_target
from datastore.service.shm import ClientMaps
from datastore.service.watch import this_process
from datastore.service.wire import MAX_MESSAGE, ReceivedBatch, parse_batch

__all__ = [
    "JOB_ENV",
    "TRANSPORTS",
    "Client",
    "Received",
    "RemoteBatches",
    "client_process",
    "job_identity",
    "open_channel",
    "raise_for",
    "stream_batches",
    "target_of",
]

MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


TRANSPORTS = {
    "auto": pb.TRANSPORT_UNSPECIFIED,
    "shm": pb.TRANSPORT_SHARED_MEMORY,
    "inline": pb.TRANSPORT_INLINE,
}


JOB_ENV = (
    "SLURM_JOB_ID",
    "FLUX_JOB_ID",
    "PBS_JOBID",
    "LSB_JOBID",
    "COBALT_JOBID",
    "TORCHELASTIC_RUN_ID",
)
"""Where :func:`job_identity` looks, in order: the batch systems' job ids, then torchrun's."""


def job_identity(env: Mapping[str, str] | None = None) -> str:
    """The job a client belongs to, as ``datastore status`` shows it: the first of
    :data:`JOB_ENV` set (``TORCHELASTIC_RUN_ID`` as ``torchrun:ID``; its placeholder ``none``
    skipped; Slurm's as ``JOB.STEP`` inside a step: the steps of a sweep in one allocation are
    other jobs, one's failure not theirs), else ``HOST:PID`` of this process."""
    env = os.environ if env is None else env
    for name in JOB_ENV:
        value = env.get(name, "").strip()
        if name == "SLURM_JOB_ID" and value and env.get("SLURM_STEP_ID", "").strip():
            return f"{value}.{env['SLURM_STEP_ID'].strip()}"
        if name == "TORCHELASTIC_RUN_ID":
            if value and value != "none":
                return f"torchrun:{value}"
        elif value:
            return value
    return f"{os.uname().nodename}:{os.getpid()}"


def client_process() -> pb.ClientProcess | None:
    """This process as ``OpenSession`` describes it (its end closes the session); ``None``
    where ``/proc`` does not tell (not Linux)."""
    me = this_process()
    return None if me is None else pb.ClientProcess(pid=me[0], start_ticks=me[1], boot_id=me[2])


def open_channel(target: str, tls_ca: str | os.PathLike | None = None) -> grpc.Channel:
    """A channel to ``target``: TLS checked against the PEM ``tls_ca`` when given.

    Raises:
        OSError: ``tls_ca`` cannot be read, or holds no PEM certificate.
    """
    if tls_ca is None:
        return grpc.insecure_channel(target, options=MESSAGE_OPTIONS)
    with open(tls_ca, "rb") as f:
        pem = f.read()
    try:  # (gRPC would print C-core lines, then fail each call as if nobody listened)
        ssl.create_default_context(cadata=pem.decode("ascii", "replace"))
    except ssl.SSLError as exc:
        raise OSError(f"{tls_ca}: no PEM certificate in it ({exc.reason or exc})") from None
    credentials = grpc.ssl_channel_credentials(root_certificates=pem)
    return grpc.secure_channel(target, credentials, options=MESSAGE_OPTIONS)


def stream_batches(channel: grpc.Channel) -> grpc.StreamStreamMultiCallable:
    """``StreamBatches`` on ``channel``, its replies parsed into ``ReceivedBatch`` objects by
    :func:`~datastore.service.wire.parse_batch` (inline payloads: views of the message)."""
    method = pb.DESCRIPTOR.services_by_name["DataStore"].methods_by_name["StreamBatches"]
    return channel.stream_stream(
        f"/{method.containing_service.full_name}/{method.name}",
        request_serializer=pb.StreamBatchesRequest.SerializeToString,
        response_deserializer=parse_batch,
    )


def target_of(address: str | os.PathLike) -> str:
    """A gRPC target from an address: ``unix://...``, ``HOST:PORT``, or a socket path (one
    with a ``/``, ending ``.sock``, or without a port)."""
    a = os.fspath(address)
    if a.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return a
    if "/" in a or a.endswith(".sock") or ":" not in a:
        return unix_target(a)
    port = a.rpartition(":")[2]
    if port.isascii() and port.isdigit() and int(port) > 65535:  # gRPC: port mod 65536
        raise ValueError(f"the port of {a!r} must be 0..65535")
    return a


class Client:
    """A connection to one service, over its Unix socket or over TCP with a token.

    A failed call raises what :func:`raise_for` maps its gRPC status to (``ServiceUnavailable``,
    ``DatasetNotFound``, ``PathNotAllowed``, ``ValueError``, ``DataStoreError``).

    Args:
        address: the service, as :func:`target_of` reads it: a Unix socket path,
            ``unix://PATH`` or ``HOST:PORT``.
        token: the shared secret sent on every call (TCP). Default: none.
        timeout_s: deadline of each call; ``None``: none. Default: ``5.0``.
        tls_ca: PEM certificate(s) to check a TLS service against (TCP). Default: plaintext.
    """

    def __init__(
        self,
        address: Path | str,
        *,
        token: str | None = None,
        timeout_s: float | None = 5.0,
        tls_ca: Path | str | None = None,
    ) -> None:
        self.target = target_of(address)
        self.address = os.fspath(address)
        unix = self.target.startswith("unix:")
        self._channel = open_channel(self.target, None if unix else tls_ca)
        self._stub = pb_grpc.DataStoreStub(self._channel)
        self._metadata = bearer(token) if token else None
        self._timeout = timeout_s

    def _call(self, method: str, request: Any) -> Any:
        """The reply of ``method``; a failure as :func:`raise_for` maps it."""
        try:
            return getattr(self._stub, method)(
                request, timeout=self._timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise raise_for(exc, self.address) from None

    def status(self) -> Any:
        """The ``Status`` reply."""
        return self._call("Status", pb.StatusRequest())

    def load(self, path: str, *, wait: bool = False) -> Any:
        """The ``LoadDataset`` reply for the dataset at ``path`` (on the service's node)."""
        return self._call("LoadDataset", pb.LoadDatasetRequest(dataset_path=path, wait=wait))

    def describe(self, path: str) -> tuple[int, dict[str, FieldInfo]]:
        """``(samples, {name: FieldInfo})`` of the dataset at ``path`` (on the service's node) as
        the service serves it: on several nodes, the whole store's, not this node's share.
        Opens a session and closes it (the dataset becomes resident, as for a first job)."""
        request = pb.OpenSessionRequest(dataset_path=path, global_batch=1, world_size=1)
        reply = self._call("OpenSession", request)
        self._call("CloseSession", pb.CloseSessionRequest(session_id=reply.session_id))
        fields = {
            f.name: FieldInfo(f.name, np.dtype(f.dtype), tuple(f.shape), tuple(f.spatial_axes))
            for f in reply.fields
        }
        return int(reply.num_samples), fields

    def unload(self, path: str) -> Any:
        """The ``UnloadDataset`` reply for the resident dataset at ``path``."""
        return self._call("UnloadDataset", pb.UnloadDatasetRequest(dataset_path=path))

    def shutdown(self, *, grace_s: float = 0.0, reason: str = "") -> Any:
        """Ask the service to drain and exit."""
        return self._call("Shutdown", pb.ShutdownRequest(grace_s=grace_s, reason=reason))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raise_for(exc: grpc.RpcError, address: str) -> Exception:
    """The ``datastore.errors`` error for a failed call to the service at ``address`` (the
    same types the embedded loader raises for the same fault), to raise in its place.

    ``UNAVAILABLE`` is a ``ServiceUnavailable`` ("is `datastore serve` running at ADDRESS?"
    when nobody listens there), ``NOT_FOUND`` a ``DatasetNotFound``, ``PERMISSION_DENIED`` a
    ``PathNotAllowed``, a refused argument a ``ValueError`` with the service's message; any
    other status a ``DataStoreError``. The status stays readable for callers that report it (the
    CLI): ``grpc_status`` (a ``grpc.StatusCode``) and ``grpc_details`` on the error returned.
    """
    code = exc.code() if hasattr(exc, "code") else None
    details = str(exc.details()) if hasattr(exc, "details") else str(exc)
    err: Exception
    if code == grpc.StatusCode.UNAVAILABLE:
        # nobody listens there; not a peer of it down ("node K (HOST:PORT) ...", which may
        # say "connection" too: the service asked is up and names the node that is not)
        if "connect" in details.lower() and not details.startswith("node "):
            err = ServiceUnavailable(
                f"no answer from {address} ({details}): is `datastore serve` running at {address}?"
            )
        else:
            err = ServiceUnavailable(f"datastore serve at {address}: {details}")
    elif code == grpc.StatusCode.NOT_FOUND:
        err = DatasetNotFound(details)
    elif code == grpc.StatusCode.PERMISSION_DENIED:
        err = PathNotAllowed(details)
    elif code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
    ):
        err = ValueError(details)
    else:
        name = code.name if code is not None else "error"
        err = DataStoreError(f"datastore serve at {address}: {name}: {details}")
    status = code if code is not None else grpc.StatusCode.UNKNOWN
    err.grpc_status, err.grpc_details = status, details  # type: ignore[attr-defined]
    return err


@dataclass
class Received:
    """One streamed batch: ``arrays`` (numpy) and where they live.

    Attributes:
        header: the ``Batch`` message without its tensors (step, epoch, sample indices).
        arrays: ``{field: array}``: read-only views of the message (inline), views of the
            service's segment (shared memory), or a fresh buffer that is the caller's
            (``owned``: an inline batch reassembled from chunks).
        generation: a shared-memory batch's region, to return with :meth:`RemoteBatches.done`
            once nothing reads it any more; ``None`` otherwise.
        owned: the arrays are the caller's to keep and write.
    """

    header: Any
    arrays: dict[str, np.ndarray]
    generation: int | None = None
    owned: bool = False


class RemoteBatches:
    """The batches of one ``StreamBatches`` call, as :class:`Received` objects.

    Iterating pulls one message at a time (gRPC flow control bounds what is in flight);
    ``close()`` cancels the call, which stops the service producing. Shared-memory regions
    stay the service's until the caller returns their generations (:meth:`done`); ``maps``
    (the segments mapped) and ``held`` (the generations the caller still reads) outlive the
    call: the next stream of the rank reuses the segment and keeps what is held. An inline
    batch larger than one message arrives in chunks (``Batch.chunk_total``) and is
    reassembled into one buffer the caller owns.
    """

    def __init__(
        self,
        stream: grpc.StreamStreamMultiCallable,
        request: Any,
        metadata: Any = None,
        maps: ClientMaps | None = None,
        held: Iterable[int] = (),
    ) -> None:
        self._maps = ClientMaps() if maps is None else maps
        request.held.extend(held)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox.put(request)
        self._call = stream(self._requests(), metadata=metadata)

    def _requests(self) -> Iterator[Any]:
        while (r := self._outbox.get()) is not None:
            yield r

    def done(self, generations: list[int]) -> None:
        """The caller no longer reads these shared-memory regions: the service may reuse them."""
        if generations:
            self._outbox.put(pb.StreamBatchesRequest(done=list(generations)))

    def _shared(self, b: ReceivedBatch) -> Received:
        arrays, generation = {}, None
        for t in b.tensors:
            dtype, shape = np.dtype(t.meta.dtype), tuple(t.meta.shape)
            fresh = t.shm.path not in self._maps
            arrays[t.meta.name] = self._maps.array(t.shm.path, t.shm.offset, dtype, shape)
            if fresh:  # the service removes the file now: nothing is left behind after us
                self._outbox.put(pb.StreamBatchesRequest(mapped=True))
            generation = int(t.shm.generation)
        return Received(b.header, arrays, generation)

    def __iter__(self) -> Iterator[Received]:
        try:
            chunks: _Chunks | None = None
            for b in self._call:
                if chunks is not None and not b.header.chunk_total:
                    raise ValueError(f"step {chunks.header.step}: a chunked batch left unfinished")
                if b.header.chunk_total:
                    chunks = _Chunks(b) if chunks is None else chunks
                    chunks.add(b)
                    if chunks.complete:
                        yield chunks.received()
                        chunks = None
                elif any(t.shm is not None for t in b.tensors):
                    yield self._shared(b)
                else:  # views of the message, read-only: its bytes are never written
                    arrays = {
                        t.meta.name: np.frombuffer(t.data or b"", np.dtype(t.meta.dtype)).reshape(
                            tuple(t.meta.shape)
                        )
                        for t in b.tensors
                    }
                    yield Received(b.header, arrays)
            if chunks is not None:
                raise ValueError(f"step {chunks.header.step}: the stream ended mid-batch")
        finally:
            self.close()

    def close(self) -> None:
        self._call.cancel()
        self._outbox.put(None)


class _Chunks:
    """An inline batch arriving in several messages, copied into one fresh array per tensor
    (the caller's; the messages are only read)."""

    def __init__(self, first: ReceivedBatch) -> None:
        h = first.header
        if h.chunk_offset != 0 or not first.tensors:
            raise ValueError(f"step {h.step}: a chunked batch must start with its header")
        self.header, self.metas = h, [t.meta for t in first.tensors]
        self.arrays: dict[str, np.ndarray] = {}
        self._flat: list[tuple[int, np.ndarray]] = []  # (offset in the payload, bytes)
        at = 0
        for m in self.metas:
            dtype, shape = np.dtype(m.dtype), tuple(int(n) for n in m.shape)
            if m.nbytes != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"step {h.step}: tensor {m.name!r} has {m.nbytes} bytes")
            arr = self.arrays[m.name] = np.empty(shape, dtype)
            self._flat.append((at, arr.reshape(-1).view(np.uint8)))
            at += arr.nbytes
        if at != h.chunk_total:
            raise ValueError(f"step {h.step}: the chunks' total disagrees with the tensors'")
        self.total, self.filled = at, 0

    def add(self, b: ReceivedBatch) -> None:
        h, data = b.header, b.chunk if b.chunk is not None else memoryview(b"")
        if h.step != self.header.step or h.chunk_offset != self.filled:
            raise ValueError(
                f"step {self.header.step}: chunk at {h.chunk_offset} of step {h.step} arrived "
                f"where byte {self.filled} was expected"
            )
        if self.filled + len(data) > self.total:
            raise ValueError(f"step {h.step}: the chunks run past the batch's {self.total} bytes")
        src, lo, hi = np.frombuffer(data, np.uint8), self.filled, self.filled + len(data)
        for start, flat in self._flat:
            a, z = max(lo, start), min(hi, start + flat.nbytes)
            if a < z:
                flat[a - start : z - start] = src[a - lo : z - lo]
        self.filled = hi

    @property
    def complete(self) -> bool:
        return self.filled == self.total

    def received(self) -> Received:
        header = pb.Batch()
        header.CopyFrom(self.header)
        del header.tensors[:]
        return Received(header, self.arrays, owned=True)

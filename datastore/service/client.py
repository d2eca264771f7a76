"""Channels to ``datastore serve``, the calls the CLI makes, and ``RemoteLoader``.

``RemoteLoader`` is what ``DataStoreLoader(..., address=...)`` returns: the same iteration API
(``__len__``, ``__iter__``, ``set_epoch``, ``state_dict``/``load_state_dict``), with the batches
streamed by the service (inline bytes) instead of read in this process.
"""

from __future__ import annotations

import collections
import math
import os
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from datastore.order import EpochPosition, Schedule, rank_layout
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
from datastore.service.auth import bearer
from datastore.service.paths import unix_target
from datastore.service.shm import ClientMaps
from datastore.service.wire import (
    ReceivedBatch,
    ReceivedTensor,
    keep_large_blocks,
    parse_batch,
    received_array,
)

if TYPE_CHECKING:
    import torch  # imported where tensors are made: the CLI's calls start without it

__all__ = [
    "TRANSPORTS",
    "Client",
    "RemoteBatches",
    "RemoteLoader",
    "open_channel",
    "stream_batches",
    "target_of",
]

MAX_MESSAGE = 256 * 1024 * 1024  # as the server: a batch is one message
MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


TRANSPORTS = {
    "auto": pb.TRANSPORT_UNSPECIFIED,
    "shm": pb.TRANSPORT_SHARED_MEMORY,
    "inline": pb.TRANSPORT_INLINE,
}


def open_channel(target: str, tls_ca: str | os.PathLike | None = None) -> grpc.Channel:
    """A channel to ``target``: TLS checked against the PEM ``tls_ca`` when given."""
    if tls_ca is None:
        return grpc.insecure_channel(target, options=MESSAGE_OPTIONS)
    with open(tls_ca, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
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
    """A gRPC target from an address: ``unix://...``, ``HOST:PORT``, or a socket path."""
    a = os.fspath(address)
    if a.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return a
    if "/" in a or a.endswith(".sock"):
        return unix_target(a)
    return a


class Client:
    """A connection to one service, over its Unix socket or over TCP with a token.

    Args:
        socket: the Unix socket path (ignored with ``tcp``).
        tcp: ``HOST:PORT``. Default: none.
        token: the shared secret sent on every call (TCP). Default: none.
        timeout_s: deadline of each call; ``None``: none. Default: ``5.0``.
        tls_ca: PEM certificate(s) to check a TLS service against (TCP). Default: plaintext.
    """

    def __init__(
        self,
        socket: Path | str | None = None,
        *,
        tcp: str | None = None,
        token: str | None = None,
        timeout_s: float | None = 5.0,
        tls_ca: Path | str | None = None,
    ) -> None:
        if tcp is None and socket is None:
            raise ValueError("a socket path or a TCP address is needed")
        self.target = tcp if tcp is not None else unix_target(socket)  # type: ignore[arg-type]
        self._channel = open_channel(self.target, tls_ca if tcp is not None else None)
        self._stub = pb_grpc.DataStoreStub(self._channel)
        self._metadata = bearer(token) if token else None
        self._timeout = timeout_s

    def status(self) -> Any:
        """The ``Status`` reply."""
        return self._stub.Status(pb.StatusRequest(), timeout=self._timeout, metadata=self._metadata)

    def load(self, path: str, *, wait: bool = False) -> Any:
        """The ``LoadDataset`` reply for the dataset at ``path`` (on the service's node)."""
        return self._stub.LoadDataset(
            pb.LoadDatasetRequest(dataset_path=path, wait=wait),
            timeout=self._timeout,
            metadata=self._metadata,
        )

    def unload(self, path: str) -> Any:
        """The ``UnloadDataset`` reply for the resident dataset at ``path``."""
        return self._stub.UnloadDataset(
            pb.UnloadDatasetRequest(dataset_path=path),
            timeout=self._timeout,
            metadata=self._metadata,
        )

    def shutdown(self, *, grace_s: float = 0.0, reason: str = "") -> Any:
        """Ask the service to drain and exit."""
        return self._stub.Shutdown(
            pb.ShutdownRequest(grace_s=grace_s, reason=reason),
            timeout=self._timeout,
            metadata=self._metadata,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteBatches:
    """The batches of one ``StreamBatches`` call as ``(step, {field: tensor})``.

    Iterating pulls one message at a time (gRPC flow control bounds what is in flight);
    ``close()`` (or dropping it) cancels the call, which stops the server producing.

    Inline tensors are views of the message received for them (parsed by
    :func:`~datastore.service.wire.parse_batch`), which nothing else holds: writable and the
    caller's, no copy (a payload not aligned for its dtype is copied). Shared-memory tensors are
    views of the service's segment, no copy: a batch stays valid until ``hold`` further
    batches have been drawn, then its generation is returned to the service for reuse.
    ``maps`` and ``held`` (the generations still read) outlive the call: the next stream of
    the rank reuses the segment and takes over what is held.
    """

    def __init__(
        self,
        stream: grpc.StreamStreamMultiCallable,
        request: Any,
        metadata: Any = None,
        hold: int = 3,
        maps: ClientMaps | None = None,
        held: collections.deque[int] | None = None,
    ) -> None:
        self._maps = ClientMaps() if maps is None else maps
        self._held: collections.deque[int] = collections.deque() if held is None else held
        self._hold = max(1, hold)
        request.held.extend(self._held)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox.put(request)
        self._call = stream(self._requests(), metadata=metadata)

    def _requests(self) -> Iterator[Any]:
        while (r := self._outbox.get()) is not None:
            yield r

    def _tensor(self, t: ReceivedTensor) -> torch.Tensor:
        import torch

        dtype, shape = np.dtype(t.meta.dtype), tuple(t.meta.shape)
        if t.shm is not None:
            fresh = t.shm.path not in self._maps
            arr = self._maps.array(t.shm.path, t.shm.offset, dtype, shape)
            if fresh:  # the service removes the file now: nothing is left behind after us
                self._outbox.put(pb.StreamBatchesRequest(mapped=True))
            return torch.from_numpy(arr)
        return torch.from_numpy(received_array(t.data or memoryview(b""), dtype, shape))

    def __iter__(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        try:
            b: ReceivedBatch
            for b in self._call:
                batch = {t.meta.name: self._tensor(t) for t in b.tensors}
                shared = [t.shm.generation for t in b.tensors if t.shm is not None]
                if shared:
                    self._held.append(shared[0])
                    if len(self._held) > self._hold:
                        self._outbox.put(pb.StreamBatchesRequest(done=[self._held.popleft()]))
                yield b.header.step, batch
        finally:
            self.close()

    def close(self) -> None:
        self._call.cancel()
        self._outbox.put(None)


class RemoteLoader(EpochPosition):
    """``DataStoreLoader``'s API over ``datastore serve``: one session per loader.

    Takes ``DataStoreLoader``'s arguments that fix the sample sequence, ``fields`` and
    ``prefetch`` (the rest, such as ``memory_budget``, are the service's business and ignored).

    Args:
        address: a Unix socket path, ``unix://PATH`` or ``HOST:PORT``.
        token: the shared secret for TCP. Default: none.
        transport: ``"auto"`` (shared memory over the Unix socket, inline bytes over TCP),
            ``"shm"`` or ``"inline"``. Default: ``"auto"``. Shared-memory tensors are views of
            the service's memory, valid until ``prefetch + 1`` further batches are drawn (as the
            embedded loader's); ``.clone()`` one to keep it longer.
        job_id: shown by ``datastore status``. Default: ``$SLURM_JOB_ID``.
        tls_ca: PEM certificate(s) to check a TLS service against (TCP). Default: plaintext.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = None,
        *,
        address: str,
        global_batch_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        spatial: dict[str, Any] | None = None,
        rank: int | None = None,
        world: int | None = None,
        fields: list[str] | None = None,
        prefetch: int = 2,
        token: str | None = None,
        transport: str = "auto",
        job_id: str = "",
        tls_ca: str | os.PathLike | None = None,
        **_ignored: Any,
    ) -> None:
        from datastore.world import detect_world

        if not isinstance(dataset, (str, os.PathLike)):
            raise TypeError("a remote loader takes a dataset path (the server's node)")
        w = detect_world(rank, world, None)
        self.rank, self.world_size = w.rank, w.size
        blocks = math.prod(spatial["parts"]) if spatial else 1
        self.layout = rank_layout(self.rank, self.world_size, blocks)
        if (batch_size is None) == (global_batch_size is None):
            raise ValueError("give exactly one of batch_size (per rank) and global_batch_size")
        gb = (
            global_batch_size
            if global_batch_size is not None
            else batch_size * self.layout.data_world  # type: ignore[operator]
        )
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.transport, self.prefetch = TRANSPORTS[transport], max(1, prefetch)
        self.target = target_of(address)
        self._channel = open_channel(self.target, tls_ca)
        self._stub = pb_grpc.DataStoreStub(self._channel)
        self._stream_batches = stream_batches(self._channel)
        self._metadata = bearer(token) if token else None
        unix = self.target.startswith("unix:")
        if transport == "inline" or (transport == "auto" and not unix):
            keep_large_blocks()  # inline batches: messages and tensors of tens of MiB
        layout = pb.SpatialLayout()
        if spatial:
            layout = pb.SpatialLayout(
                parts=list(spatial["parts"]),
                halo=list(spatial.get("halo", ())),
                boundary=spatial.get("boundary", ""),
            )
        self._open_request = pb.OpenSessionRequest(
            dataset_path=os.path.abspath(os.fspath(dataset)),
            seed=seed,
            global_batch=max(0, gb),
            world_size=self.world_size,
            spatial=layout,
            shuffle=shuffle,
            drop_last=drop_last,
            job_id=job_id or os.environ.get("SLURM_JOB_ID", ""),
            fields=list(fields or ()),
        )
        reply = self._open()
        self.num_samples = reply.num_samples
        self.fields = list(reply.fields)
        self.schedule = Schedule(
            int(reply.num_samples), gb, seed, shuffle, "drop" if drop_last else "pad"
        )
        assert self.schedule.steps_per_epoch == reply.steps_per_epoch
        self.batch_size = self.schedule.local_batch(self.layout.data_world)
        self.epoch, self._step = 0, 0

    def _open(self) -> Any:
        reply = self._stub.OpenSession(self._open_request, timeout=60, metadata=self._metadata)
        self.session_id = reply.session_id
        self._maps, self._held = ClientMaps(), collections.deque()  # a new session's segments
        return reply

    def _stream(self) -> RemoteBatches:
        request = pb.StreamBatchesRequest(
            session_id=self.session_id,
            rank=self.rank,
            epoch=self.epoch,
            start_step=self._step,
            transport=self.transport,
            prefetch=self.prefetch,
        )
        return RemoteBatches(
            self._stream_batches,
            request,
            self._metadata,
            hold=self.prefetch + 1,
            maps=self._maps,
            held=self._held,
        )

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        finished = False
        stream = self._stream()
        it = iter(stream)
        try:
            first = next(it, None)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                raise
            # the service closed an idle session (or restarted): the same request gives the
            # same sequence, so reopen and carry on where this loader is
            stream.close()
            self._open()
            stream = self._stream()
            it = iter(stream)
            first = next(it, None)
        try:
            if first is None:
                finished = True
                return
            self._step = first[0] + 1
            yield first[1]
            for step, batch in it:
                self._step = step + 1
                yield batch
            finished = True
        finally:
            stream.close()
            self._end_iteration(finished)

    def close(self) -> None:
        """Close the session (freeing its slots on the service) and the channel; tensors
        already handed out stay valid."""
        if self._channel is None:
            return
        try:
            self._stub.CloseSession(
                pb.CloseSessionRequest(session_id=self.session_id),
                timeout=10,
                metadata=self._metadata,
            )
        except grpc.RpcError:
            pass  # the server is gone: nothing left to free
        finally:
            self._channel.close()
            self._channel = None
            self._maps.drop()

    def __enter__(self) -> RemoteLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The service source: ``datastore serve`` streams a rank's batches (one session per loader).

The session fixes the sample sequence exactly as the embedded loader does (the same
``Schedule``), so both give the same batches. What arrives:

- **inline** (TCP, or ``transport="inline"``): the batch's bytes in the message, copied once
  into a buffer of the loader's ring (the message's bytes are never written);
- **shared memory** (same node): regions of the service's segment. Handed out as they are
  (no copy) while the consumer drops its batches: a region goes back to the service only once
  no tensor views it any more. A consumer that keeps batches would stall the service, so past
  ``hold`` kept regions the batches are copied into the loader's own buffers instead and their
  regions go back at once. With ``device=``, the segment is page-locked for CUDA
  (``cudaHostRegister``) and copied straight to the GPU; the region goes back once the copy
  is done.

Every byte is copied once on the way, by the service's parallel gather from its resident
copy into the segment. A pass is one ``StreamBatches`` call, which the service fills ahead of
the consumer. Over shared memory the next pass is requested ahead too: the last batch of an
epoch opens a stream of the next epoch's first ``prefetch`` batches (the pass a loader makes
next unless told otherwise), which the service fills while the consumer finishes this epoch;
the first of those batches opens the rest of that epoch. A pass that starts elsewhere cancels
it (the service frees what it filled).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from datastore.errors import DataStoreError
from datastore.maths.rank_view import global_batch
from datastore.readers.base import FieldInfo
from datastore.sources.options import ServiceOptions
from datastore.store.gather import Gather
from datastore.store.ring import Buffer, BufferRing
from datastore.store.store import Counters

__all__ = ["ServiceSource"]


class ServiceSource:
    """One session of ``datastore serve`` for one rank.

    Args:
        dataset: the dataset's path on the service's node.
        service: the service and how to reach it (address, token, transport, job id, TLS CA).
        options: the loader's checked options (``datastore.loader.LoaderOptions``), which give
            the rank's view of the job.
        world: this rank and the world size.
        gather: copies into the ring's buffers.
        copies_on: the CUDA stream that copies batches to the device (``device=``): the
            shared-memory segments are then page-locked for it. Default: ``None``.
    """

    steps_together = True  # one stream per session: a loader runs one pass at a time

    def __init__(
        self,
        dataset: Any,
        service: ServiceOptions,
        *,
        options: Any,
        world: Any,
        gather: Gather,
        copies_on: Any = None,
    ) -> None:
        from datastore.service._pb.v1 import datastore_pb2 as pb
        from datastore.service._pb.v1 import datastore_pb2_grpc as pb_grpc
        from datastore.service.auth import bearer
        from datastore.service.client import (
            TRANSPORTS,
            client_process,
            job_identity,
            open_channel,
            raise_for,
            stream_batches,
            target_of,
        )
        from datastore.service.wire import keep_large_blocks

        if not isinstance(dataset, (str, os.PathLike)):
            raise TypeError("with service=, the dataset is a path (on the service's node)")
        self._pb, self._raise_for = pb, raise_for
        self.options, self.gather, self.counters = options, gather, Counters()
        self._copies_on = copies_on
        self.rank, self.world_size = world.rank, world.size
        spatial = options.spatial
        gb = global_batch(options.batch_size, options.global_batch_size, self.world_size, spatial)
        self.transport = TRANSPORTS[service.transport]
        self.address = service.address
        self.target = target_of(service.address)
        unix = self.target.startswith("unix:")
        self.shared = service.transport == "shm" or (service.transport == "auto" and unix)
        if not self.shared:
            keep_large_blocks()  # inline batches: messages of tens of MiB (before gRPC starts)
        self._channel = open_channel(self.target, service.tls_ca)
        self._stub = pb_grpc.DataStoreStub(self._channel)
        self._stream_batches = stream_batches(self._channel)
        self._metadata = bearer(service.token) if service.token else None
        layout = pb.SpatialLayout()
        if spatial:
            layout = pb.SpatialLayout(
                parts=list(spatial["parts"]),
                halo=list(spatial["halo"]),
                boundary=spatial["boundary"],
            )
        self._open_request = pb.OpenSessionRequest(
            dataset_path=os.path.abspath(os.fspath(dataset)),
            seed=options.seed,
            global_batch=gb,
            world_size=self.world_size,
            spatial=layout,
            shuffle=options.shuffle == "global",
            shuffle_mode="" if options.shuffle in ("global", "none") else options.shuffle,
            drop_last=options.drop_last,
            job_id=service.job_id or job_identity(),
            fields=list(options.fields or ()),
            client=client_process(),  # the service ends the session when this process ends
        )
        self._maps: Any = None  # the shared-memory mappings of the session (ClientMaps)
        self._ahead: _Open | None = None  # the next pass's stream, opened before it began
        reply = self._open()
        self._made_for = _made_for(reply)
        info = {
            f.name: FieldInfo(f.name, np.dtype(f.dtype), tuple(f.shape), tuple(f.spatial_axes))
            for f in reply.fields
        }
        asked = options.shuffle
        if reply.shuffle != asked and (reply.shuffle or asked not in ("global", "none")):
            self.close()  # a service from before the shard and window shuffles
            raise ValueError(
                f"{self.address}: the session shuffles "
                f"{reply.shuffle or 'globally or not at all'}, not shuffle={asked!r}: update "
                "datastore serve there"
            )
        view = options.view(info, int(reply.num_samples), world)
        self.grid, self.layout, self.schedule = view.grid, view.layout, view.schedule
        self.fields, self.batch_size = list(view.fields), view.local_batch
        self.identity = reply.dataset_identity  # "": a sharded dataset, or an older service
        self._kept: collections.deque[tuple[Buffer, int]] = collections.deque()
        # regions kept (queued ahead, and the consumer's) before batches are copied instead
        self.hold = options.prefetch + 2

    def _open(self) -> Any:
        from datastore.service.shm import ClientMaps

        try:
            reply = self._stub.OpenSession(
                self._open_request, timeout=self.options.timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise self._raise_for(exc, self.address) from None
        self.session_id = reply.session_id
        self._drop_ahead()
        self._mapped = False  # a segment of this session was mapped
        if self._maps is not None:  # reopened: the old session's mappings go
            self._maps.drop()
        self._maps = ClientMaps(copies_on=self._copies_on)
        self._kept = collections.deque()
        return reply

    def _reopen(self) -> None:
        """A new session for this loader's request, refused where the dataset has other
        samples or fields than when the loader was made: the same request then gave another
        sequence (a 48-sample epoch's first 32 samples where 32 were due, silently)."""
        reply = self._open()
        if _made_for(reply) != self._made_for:
            raise DataStoreError(
                f"{self.address}: the dataset changed while this loader's session was closed "
                "(the service restarted, or the session sat idle): "
                f"{self._made_for[0]} samples when the loader was made, {reply.num_samples} "
                "now, or other fields: make a new loader"
            )

    def _stream(self, epoch: int, start: int, count: int = 0) -> _Open:
        """A stream of ``count`` batches of ``epoch`` from ``start`` (``0``: to its end); the
        regions this loader still reads stay the service's concern, every other is free."""
        from datastore.service.client import RemoteBatches

        request = self._pb.StreamBatchesRequest(
            session_id=self.session_id,
            rank=self.rank,
            epoch=epoch,
            start_step=start,
            max_batches=count,
            transport=self.transport,
            prefetch=self.options.prefetch,
            mapped=self._mapped,
        )
        held = [g for _, g in self._kept]
        stream = RemoteBatches(self._stream_batches, request, self._metadata, self._maps, held)
        steps = self.schedule.steps_per_epoch
        end = steps if count == 0 else min(steps, start + count)
        return _Open(epoch, start, end, stream, iter(stream))

    def _next(self, live: _Open) -> tuple[_Open, Any]:
        """The next batch of ``live`` (``None`` at its end), and the stream it came from: a
        new one if the service had closed this loader's session (idle, or restarted): the
        same request gives the same sequence, so the session is reopened and carries on."""
        try:
            got = next(live.items, None)
        except grpc.RpcError as exc:
            if live.started or exc.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                raise
            live.stream.close()
            self._reopen()
            live = self._stream(live.epoch, live.start, live.end - live.start)
            got = next(live.items, None)
        live.started = True
        return live, got

    def _take_ahead(self, epoch: int, start: int) -> _Open | None:
        """The stream opened ahead, if it is the one this pass needs (else it is cancelled)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and (ahead.epoch, ahead.start) == (epoch, start):
            return ahead
        if ahead is not None:
            ahead.stream.close()
        return None

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead.stream.close()
            self._ahead = None

    def _open_next(self, epoch: int, step: int) -> _Open | None:
        """Where a stream ends at ``step``: the stream of the rest of ``epoch``, or over shared
        memory the first batches of the next epoch, kept for the next pass."""
        steps = self.schedule.steps_per_epoch
        if step < steps:
            return self._stream(epoch, step)
        if self.shared:
            self._ahead = self._stream(epoch + 1, 0, self.options.prefetch)
        return None

    def batches(
        self, epoch: int, start: int, stop: threading.Event, ring: BufferRing
    ) -> Iterator[tuple[int, Buffer]]:
        """``(step, buffer)`` of ``epoch`` from ``start``, as the service streams them. A
        stream's last batch opens the stream that follows (:meth:`_open_next`) before it is
        handed on, so the service fills the next batches while the consumer works."""
        live = self._take_ahead(epoch, start)
        if live is None and start < self.schedule.steps_per_epoch:
            live = self._stream(epoch, start)
        try:
            while live is not None:
                live, got = self._next(live)
                if got is None or stop.is_set():
                    return
                self._return_free(live.stream)
                buf = self._buffer(live.stream, ring, got)
                self._mapped = self._mapped or got.generation is not None
                step = int(got.header.step)
                if step + 1 == live.end:  # held now counts this batch's region
                    live.stream.close()
                    live = self._open_next(epoch, step + 1)
                yield step, buf
        except grpc.RpcError as exc:
            raise self._raise_for(exc, self.address) from None
        finally:
            if live is not None:
                live.stream.close()

    def _buffer(self, stream: Any, ring: BufferRing, got: Any) -> Buffer:
        """The batch in a buffer: the service's region itself, a reassembled batch the loader
        now owns, or a copy in one of the ring's buffers."""
        if got.owned:
            buf = Buffer({n: torch.from_numpy(a) for n, a in got.arrays.items()})
            buf.pending = True
            return buf
        if got.generation is not None and len(self._kept) < self.hold:
            buf = Buffer({n: torch.from_numpy(a) for n, a in got.arrays.items()})
            buf.pending = True
            self._kept.append((buf, got.generation))
            return buf
        buf = ring.take()
        try:
            self.gather.run([(buf.arrays[n], a) for n, a in got.arrays.items()])
        except BaseException:
            ring.give_back(buf)
            raise
        if got.generation is not None:
            stream.done([got.generation])
        return buf

    def _return_free(self, stream: Any) -> None:
        """Give the service back the regions nobody views any more."""
        free = [g for b, g in self._kept if not b.held()]
        if free:
            self._kept = collections.deque((b, g) for b, g in self._kept if g not in free)
            stream.done(free)

    def close(self) -> None:
        """Close the session (freeing its slots on the service) and the channel."""
        if self._channel is None:
            return
        self._drop_ahead()
        try:
            self._stub.CloseSession(
                self._pb.CloseSessionRequest(session_id=self.session_id),
                timeout=min(10.0, self.options.timeout),
                metadata=self._metadata,
            )
        except grpc.RpcError:
            pass  # the service is gone: nothing left to free
        finally:
            self._channel.close()
            self._channel = None
            self._maps.drop()


def _made_for(reply: Any) -> tuple:
    """What an ``OpenSession`` reply gives a loader its schedule and buffers by: the sample
    count and each field's name, dtype and shape."""
    return reply.num_samples, [(f.name, f.dtype, tuple(f.shape)) for f in reply.fields]


@dataclass
class _Open:
    """An open stream of steps ``start..end-1`` of ``epoch``, and its batches as they come."""

    epoch: int
    start: int
    end: int
    stream: Any  # RemoteBatches
    items: Iterator[Any]
    started: bool = False  # a batch came: the session was open

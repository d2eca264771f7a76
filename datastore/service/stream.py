"""One ``StreamBatches`` call: a producer thread prepares a rank's batches ahead into slots.

Slots (:class:`SlotRing`, one per rank of a session, kept across its streams) bound how many
batches are prepared ahead. For zero-copy delivery they are regions of one shared-memory
:class:`~datastore.service.shm.Segment`; inline batches are gathered straight into their
messages (:func:`~datastore.service.wire.batch_message`; a batch over :func:`chunk_bytes` into
the several messages of :func:`~datastore.service.wire.chunk_messages`), and a slot only counts
one. The producer takes a slot only once it is free again, so memory is bounded whatever the
client does:

- inline: a slot is free as soon as its message (or first chunk) goes to gRPC (gRPC's flow
  control then bounds what is in flight);
- shared memory: a slot is free once the client returns its generation in ``done``; a client
  that stops returning slots stops the producer, never makes it buffer.

The stream ends at the end of its range, when the client cancels or dies (``stop``), or when
the service shuts down.
"""

from __future__ import annotations

import collections
import errno
import itertools
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from datastore.maths.delivery import Delivered, batch_pad_copies, part_copy
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.errors import ServiceError
from datastore.service.resident import Fetching
from datastore.service.shm import Segment
from datastore.service.wire import MAX_MESSAGE, ChunkedBatch, batch_message, chunk_messages
from datastore.store.gather import Gather, fill_batch, run_copies

__all__ = ["CHUNK_BYTES", "SlotRing", "Stream", "chunk_bytes"]

CHUNK_BYTES = 64 << 20  # inline batches larger than this go in chunks (gRPC caps at 256 MiB)
_HEADROOM = 1 << 20  # what a chunk's message holds beside its payload is far less


def chunk_bytes() -> int:
    """The largest inline payload sent as one message: :data:`CHUNK_BYTES`, or
    ``DATASTORE_INLINE_CHUNK`` bytes from the service's environment (e.g. to test chunking
    with small data).

    Raises:
        ValueError: ``DATASTORE_INLINE_CHUNK`` is not a whole number of bytes from 1 to
            1 MiB under the 256 MiB message cap.
    """
    raw = os.environ.get("DATASTORE_INLINE_CHUNK", "").strip()
    if not raw:
        return CHUNK_BYTES
    top = MAX_MESSAGE - _HEADROOM
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= top:
        raise ValueError(f"DATASTORE_INLINE_CHUNK must be bytes from 1 to {top}, got {raw!r}")
    return n


class SlotRing:
    """The batch slots of one rank of a session, kept across its streams (epochs).

    Shared-memory slots are regions of one :class:`Segment`, reused for the whole session,
    each slot's pages faulted in on the ``gather``'s threads when it is first taken (faulting
    fresh shared memory in during a fill costs more than the fill; the whole segment at once
    delayed a stream's first batch, 70-90 ms for 192 MiB, where its first slot takes 12-15).
    A slot is free again once its batch is in a message (inline) or once the client returns
    the batch's generation (shared memory); generations count up across streams, so a client
    may return the last batches of one epoch while it streams the next. A slot given back
    while a failed fetch may still write into it is lent again only once the fetch says no
    byte can land there any more.
    """

    def __init__(
        self,
        fields: list[Delivered],
        batch_size: int,
        nslots: int,
        shared: bool,
        gather: Gather | None = None,
    ) -> None:
        self.budgeted = 0  # bytes the residency counts for this ring (shared memory or inline)
        self.fields = fields
        self.segment: Segment | None = None
        self.at: dict[str, int] = {}  # where each field starts in a shared-memory slot
        self.mapped = threading.Event()
        self._gather = gather
        self._fresh: set[int] = set()  # shared-memory slots whose pages are not in place yet
        shapes = {f.name: (batch_size, *f.shape) for f in fields}
        if shared:  # a new file is all zeros: halos outside the volume start at zero
            self.segment = Segment(nslots, batch_size * sum(f.nbytes for f in fields))
            self._fresh = set(range(nslots))
            at = 0
            for f in fields:
                self.at[f.name] = at
                at += batch_size * f.nbytes
            self.slots = [
                {
                    f.name: self.segment.array(i, self.at[f.name], f.dtype, shapes[f.name])
                    for f in fields
                }
                for i in range(nslots)
            ]
        else:  # inline: a batch is filled straight into its message(s); slots only count
            self.slots = []
        self.shapes = shapes
        self.nslots = nslots
        self._free: queue.Queue = queue.Queue()
        for i in range(nslots):
            self._free.put(i)
        self._held: dict[int, int] = {}  # generation -> slot the client still reads
        self._fenced: list[tuple[int, Callable[[], bool]]] = []  # (slot, whether it is free)
        self._generations = itertools.count(1)
        self._lock = threading.Lock()
        self._lender: object = None  # the stream whose batches the client reads now

    def take(self, stop: threading.Event) -> int | None:
        """A free slot, waiting for one; ``None`` once ``stop`` is set."""
        while not stop.is_set():
            self._unfence()
            try:
                return self._placed(self._free.get(timeout=0.1))
            except queue.Empty:
                continue
        return None

    def poll(self) -> int | None:
        """A free slot if there is one now, else ``None``."""
        self._unfence()
        try:
            return self._placed(self._free.get_nowait())
        except queue.Empty:
            return None

    def _placed(self, slot: int) -> int:
        """``slot``, its pages faulted in first where this is its first use (it holds
        nothing yet). A fault-in that fails (a service stopping shuts the gather's threads
        down) puts the slot back, still to fault in."""
        if slot in self._fresh and self.segment is not None:
            try:
                self.segment.fault_in(slot, self._gather)
            except BaseException as exc:
                self._free.put(slot)
                if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                    where = self.segment.path.parent
                    raise ServiceError(
                        "RESOURCE_EXHAUSTED",
                        f"no room for a shared-memory slot of {self.segment.slot_bytes} bytes "
                        f"in {where} (DATASTORE_SHM_DIR names a larger one)",
                    ) from exc
                raise
            self._fresh.discard(slot)
        return slot

    def give(self, slot: int, freed: Callable[[], bool] | None = None) -> None:
        """``slot`` is free again, once ``freed()`` (a failed fetch's
        :meth:`~datastore.service.resident.Fetching.freed`) says nothing lands in it any more:
        till then :meth:`take` and :meth:`poll` pass it over."""
        if freed is None or freed():
            self._free.put(slot)
        else:
            with self._lock:
                self._fenced.append((slot, freed))

    def _unfence(self) -> None:
        with self._lock:
            free = [slot for slot, freed in self._fenced if freed()]
            self._fenced = [(slot, freed) for slot, freed in self._fenced if slot not in free]
        for slot in free:
            self._free.put(slot)

    def lend(self, slot: int, stream: object = None) -> int | None:
        """The client reads ``slot`` until it returns the generation this gives; ``None`` (and
        the slot is free again) when ``stream`` is no longer the rank's newest stream."""
        with self._lock:
            if stream is not self._lender:
                self._free.put(slot)
                return None
            g = next(self._generations)
            self._held[g] = slot
        return g

    def client_holds_all(self) -> bool:
        """Whether the client reads every slot (a consumer slower than the service): no batch
        can be filled until it returns one."""
        with self._lock:
            return len(self._held) >= self.nslots

    def client_mapped(self) -> None:
        """The client has mapped the segment: its file can go (the mappings stay valid)."""
        if self.segment is not None:
            self.segment.close()
        self.mapped.set()

    def keep_only(self, generations: list[int], stream: object = None) -> None:
        """Free every lent slot but those of ``generations`` (what the client still reads);
        from now on only ``stream`` lends slots (an older stream still sending could otherwise
        lend one the client never hears of, lost to the ring)."""
        keep = {int(g) for g in generations}
        with self._lock:
            self._lender = stream
            gone = [g for g in self._held if g not in keep]
            slots = [self._held.pop(g) for g in gone]
        for slot in slots:
            self._free.put(slot)

    def done(self, generations: list[int]) -> None:
        """The client no longer reads these generations' slots."""
        for g in generations:
            with self._lock:
                slot = self._held.pop(int(g), None)
            if slot is not None:
                self._free.put(slot)

    def close(self) -> None:
        """The session ended (its streams closed first): remove the segment's file and unmap
        it, so its memory goes as soon as the client's mapping does too."""
        if self.segment is not None:
            self.slots = []  # the views into the mapping
            self.segment.close()
            self.segment.unmap()


@dataclass
class _Filling:
    """A batch being filled in a slot: its message, and its blocks coming from other nodes."""

    step: int
    slot: int
    message: Any
    fetching: Fetching | None

    def ready(self) -> bool:
        """Whether every remote sample is in (or there are none)."""
        return self.fetching is None or self.fetching.arrived()


class Stream:
    """Batches ``start..end-1`` of one rank in one epoch.

    Args:
        plan: ``plan(step) -> sample indices`` of this rank's share of global batch ``step``.
        ring: the rank's slots, and the fields they hold.
        sample: ``sample(index, field)``: the stored whole sample.
        fetch: ``fetch(samples, out) -> Fetching | None``: ask for the samples other nodes
            own, to land straight in the batch ``out`` (``None``: every one is here); ``None``:
            every sample is on this node. Up to ``fetch_ahead`` batches are being fetched at
            once, as slots allow.
        steps: ``(epoch, start, end, steps_per_epoch, rank)``.
        on_stall: ``on_stall(seconds)``: time the call waited for a batch (not while the
            client held every slot: then the consumer is the one behind).
        gather: the batch copies (threads shared by the service's streams).
        fetch_ahead: batches being fetched at once, at most. Default: ``1``.
    """

    def __init__(
        self,
        *,
        plan: Callable[[int], np.ndarray],
        sample: Callable[[int, str], np.ndarray],
        fetch: Callable[[np.ndarray, dict[str, Any]], Fetching | None] | None,
        steps: tuple[int, int, int, int, int],
        ring: SlotRing,
        on_stall: Callable[[float], None],
        gather: Gather | None = None,
        fetch_ahead: int = 1,
    ) -> None:
        self._plan, self._fields, self._gather = plan, ring.fields, gather
        self._depth = max(1, fetch_ahead)
        self._sample, self._fetch = sample, fetch
        self.epoch, self.start, self.end, self._steps_per_epoch, self.rank = steps
        self._on_stall = on_stall
        self.stop = threading.Event()
        self.why = ""  # why the stream was stopped from outside (a closed session, a shutdown)
        self.failed = False  # it ended with its own error (a sample unread, a peer's refusal)
        self._ready: queue.Queue = queue.Queue()
        self.ring = ring
        self._metas = self._tensor_metas()
        self._nbytes = sum(m.nbytes for m in self._metas)
        self._chunk = chunk_bytes()
        self._worker = threading.Thread(target=self._produce, name="datastore-stream", daemon=True)

    # -- producer ------------------------------------------------------------------------------
    def _produce(self) -> None:
        """Fill the steps' batches in order. A batch whose samples other nodes own starts
        (its requests sent, its local samples copied) up to ``fetch_ahead`` steps before it
        is handed over, as long as slots are free: the owners' replies land straight in it
        meanwhile."""
        filling: collections.deque[_Filling] = collections.deque()
        step = self.start
        try:
            while step < self.end or filling:
                while filling and filling[0].ready():  # handed over as soon as it can be
                    self._complete(filling[0])
                    filling.popleft()
                slot = None
                if step < self.end and len(filling) < self._depth:
                    slot = self.ring.poll() if filling else self.ring.take(self.stop)
                    if slot is None and not filling:
                        return  # stopped
                if slot is not None:
                    filling.append(self._begin(step, slot))
                    step += 1
                elif not filling:
                    continue  # (the last batches were handed over just now)
                elif not self._complete(filling[0]):
                    return  # stopped
                else:
                    filling.popleft()
        except BaseException as exc:  # handed to the call, which fails with it
            self._ready.put((None, None, exc))
            return
        finally:
            for f in filling:  # stopped, or failed: reused once no reply lands in its slot
                if f.fetching is None:
                    self.ring.give(f.slot)
                else:
                    f.fetching.abandon()
                    self.ring.give(f.slot, f.fetching.freed)
        self._ready.put((None, None, None))

    def _begin(self, step: int, slot: int) -> _Filling:
        """Start step ``step``'s batch in ``slot``: ask for its remote samples, straight into
        their places, and copy the local ones."""
        samples = self._plan(step)
        header = self._header(step, samples)
        tensors = [(m, self.ring.shapes[m.name], m.dtype) for m in self._metas]
        out: dict[str, Any]
        if self.ring.segment is None and self._nbytes > self._chunk:
            message = chunk_messages(header, tensors, self._chunk)  # filled in place
            out = dict(message.out)
        elif self.ring.segment is None:  # inline: filled in place, in its message
            message, room = batch_message(header, tensors)
            out = {f.name: a for f, a in zip(self._fields, room, strict=True)}
        else:
            message, out = header, self.ring.slots[slot]
        fetching = self._fetch(samples, out) if self._fetch is not None else None
        if fetching is None:
            fill_batch(samples, self._fields, self._sample, out, None, self._gather)
            return _Filling(step, slot, message, None)
        try:
            copies = [
                part_copy(f, out[f.name][pos, ...], self._sample(index, f.name))
                for pos, index in enumerate(samples.tolist())
                if pos not in fetching.positions
                for f in self._fields
            ]
            for f in self._fields:  # the zero halo of the positions here (the link's: its own)
                copies += batch_pad_copies(f, out[f.name], len(samples), fetching.positions)
            run_copies(copies, self._gather)
        except BaseException:
            fetching.abandon()
            self.ring.give(slot, fetching.freed)
            raise
        return _Filling(step, slot, message, fetching)

    def _complete(self, f: _Filling) -> bool:
        """Finish ``f`` once its remote samples are in, and hand it over; ``False`` if the
        stream was stopped first."""
        if f.fetching is not None:
            after = f.fetching.result(self.stop)
            if after is None:
                return False
            run_copies(after, self._gather)
        if isinstance(f.message, ChunkedBatch):
            f.message.finish()
        self._ready.put((f.step, f.slot, f.message))
        return True

    # -- the call ------------------------------------------------------------------------------
    def messages(self) -> Iterator[tuple[Any, int]]:
        """``(Batch, payload bytes)`` in step order, until the end or an error.

        Raises:
            ServiceError: ``ABORTED`` when the stream is stopped before its last batch (its
                session closed or expired, the service stopping): a client must never take
                a cut epoch for a whole one.
        """
        self._worker.start()
        try:
            while not self.stop.is_set():
                t0, client = time.perf_counter(), self.ring.client_holds_all()
                try:
                    step, slot, message = self._ready.get(timeout=0.1)
                except queue.Empty:
                    self._stalled(t0, client)
                    continue
                self._stalled(t0, client)
                if step is None:
                    if message is not None:
                        self.failed = not self.stop.is_set()  # (not an error of its stopping)
                        raise message
                    self._until_mapped()
                    return
                yield from self._message(slot, message)
            raise self.cut()
        finally:
            self.close()

    def cut(self) -> ServiceError:
        """What the call ends with when the stream stopped before its last batch."""
        return ServiceError(
            "ABORTED",
            f"the stream of epoch {self.epoch} stopped before its last batch: "
            f"{self.why or 'stopped'}",
        )

    def _stalled(self, t0: float, client: bool) -> None:
        """The call waited for a batch since ``t0``: a stall of the service's, unless the
        client held every slot then and now (it was the one behind)."""
        if not (client and self.ring.client_holds_all()):
            self._on_stall(time.perf_counter() - t0)

    def _until_mapped(self, patience_s: float = 30.0) -> None:
        """Before the call ends, let a client that was sent regions map them first (a client
        that never says so gets ``patience_s``)."""
        if self.ring.segment is None or self.end == self.start:
            return
        deadline = time.monotonic() + patience_s
        while not self.ring.mapped.wait(0.1):
            if self.stop.is_set() or time.monotonic() > deadline:
                return

    def _header(self, step: int, samples: np.ndarray) -> Any:
        return pb.Batch(
            epoch=self.epoch,
            step=step,
            rank=self.rank,
            sample_indices=[int(i) for i in samples],
            last_in_epoch=step == self._steps_per_epoch - 1,
        )

    def _tensor_metas(self) -> list[Any]:
        return [
            pb.TensorMeta(
                name=f.name,
                dtype=f.dtype.str,
                shape=list(self.ring.shapes[f.name]),
                origin=list(f.origin),
                nbytes=math.prod(self.ring.shapes[f.name]) * f.dtype.itemsize,
            )
            for f in self._fields
        ]

    def _message(self, slot: int, message: Any) -> Iterator[tuple[Any, int, bool]]:
        """The messages of the batch in ``slot`` as ``(message, payload bytes, first)``: framed
        bytes with the tensors inline, or the chunks of a batch too large for one message (the
        slot is free again at once: gRPC's flow control bounds what is in flight); or a
        ``Batch`` to which the shared-memory regions of the slot are added."""
        if isinstance(message, bytes):
            self.ring.give(slot)
            yield message, self._nbytes, True
            return
        if isinstance(message, ChunkedBatch):
            self.ring.give(slot)
            for k, (m, n) in enumerate(zip(message.messages, message.payload, strict=True)):
                yield m, n, k == 0
            return
        seg = self.ring.segment
        generation = self.ring.lend(slot, self)
        if generation is None:
            raise ServiceError("ABORTED", f"a newer stream of rank {self.rank} took over")
        for meta in self._metas:
            region = pb.SharedMemoryRegion(
                path=str(seg.path),
                offset=seg.offset(slot) + self.ring.at[meta.name],
                length=meta.nbytes,
                generation=generation,
            )
            message.tensors.add(meta=meta, shm=region)
        yield message, self._nbytes, True

    def supersede(self) -> None:
        """A newer stream of the rank took over: stop producing (the call, still sending,
        ends itself and frees what it held)."""
        if not self.stop.is_set():
            self.why = f"a newer stream of rank {self.rank} took over"
        self.stop.set()

    def close(self, why: str = "") -> None:
        """Stop producing; safe to call twice, from any thread. Slots still filling or ready
        go back to the ring. ``why``: the reason the call reports if it had batches left."""
        if why and not self.stop.is_set():
            self.why = why
        self.stop.set()
        if self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join()
        while True:
            try:
                step, slot, _ = self._ready.get_nowait()
            except queue.Empty:
                return
            if step is not None:
                self.ring.give(slot)

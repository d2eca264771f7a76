"""One ``StreamBatches`` call: a producer thread prepares a rank's batches ahead into slots.

Slots are reused buffers: numpy arrays for inline delivery, regions of a shared-memory
:class:`~datastore.service.shm.Segment` for zero-copy delivery. The producer fills the slot of
step ``s`` only once that slot is free again, so memory is bounded whatever the client does:

- inline: a slot is free as soon as its bytes are in the message (gRPC's flow control then
  bounds what is in flight);
- shared memory: a slot is free once the client returns its step in ``done_steps``; a client
  that stops returning slots stops the producer, never makes it buffer.

The stream ends at the end of its range, when the client cancels or dies (``stop``), or when
the service shuts down; its segment is removed then.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.batches import Delivered, fill_batch
from datastore.service.shm import Segment

__all__ = ["Stream"]


class Stream:
    """Batches ``start..end-1`` of one rank in one epoch.

    Args:
        plan: ``plan(step) -> sample indices`` of this rank's share of global batch ``step``.
        fields, grid, block: what the rank receives (``datastore.service.batches``).
        sample: ``sample(index, field)``: the stored whole sample.
        fetch: ``fetch(samples)``: ``{(index, field): delivered array}`` of the samples other
            nodes own.
        batch_size: samples per batch on this rank.
        steps: ``(epoch, start, end, steps_per_epoch, rank)``.
        shared_memory: deliver through a segment, else inline bytes.
        prefetch: batches prepared ahead.
        hold: batches a shared-memory client keeps before returning the oldest.
        on_stall: ``on_stall(seconds)``: time the call waited for a batch.
    """

    def __init__(
        self,
        *,
        plan: Callable[[int], np.ndarray],
        fields: list[Delivered],
        grid: Any,
        block: int,
        sample: Callable[[int, str], np.ndarray],
        fetch: Callable[[np.ndarray], dict[tuple[int, str], np.ndarray]],
        batch_size: int,
        steps: tuple[int, int, int, int, int],
        shared_memory: bool,
        prefetch: int,
        hold: int,
        on_stall: Callable[[float], None],
    ) -> None:
        self._plan, self._fields, self._grid, self._block = plan, fields, grid, block
        self._sample, self._fetch = sample, fetch
        self.epoch, self.start, self.end, self._steps_per_epoch, self.rank = steps
        self._on_stall = on_stall
        self.stop = threading.Event()
        self._ready: queue.Queue = queue.Queue()
        self._free: queue.Queue = queue.Queue()
        sizes = [(f, batch_size * f.nbytes) for f in fields]
        nslots = prefetch + (hold + 1 if shared_memory else 1)
        self.segment: Segment | None = None
        self._slot_of: dict[int, int] = {}
        self._mapped = threading.Event()
        self._at: dict[str, int] = {}  # where each field starts in a shared-memory slot
        if shared_memory:
            self.segment = Segment(nslots, sum(n for _, n in sizes))
            self._slots = [self._views(i, batch_size) for i in range(nslots)]
        else:
            self._slots = [
                {f.name: np.zeros((batch_size, *f.shape), f.dtype) for f in fields}
                for _ in range(nslots)
            ]
        for i in range(nslots):
            self._free.put(i)
        self._worker = threading.Thread(target=self._produce, name="datastore-stream", daemon=True)

    def _views(self, slot: int, batch_size: int) -> dict[str, np.ndarray]:
        assert self.segment is not None
        out, at = {}, 0
        for f in self._fields:
            out[f.name] = self.segment.array(slot, at, f.dtype, (batch_size, *f.shape))
            out[f.name][...] = 0  # halo outside the volume stays zero
            self._at[f.name] = at
            at += out[f.name].nbytes
        return out

    # -- producer ------------------------------------------------------------------------------
    def _take_free(self) -> int | None:
        while not self.stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def _produce(self) -> None:
        try:
            for step in range(self.start, self.end):
                slot = self._take_free()
                if slot is None:
                    return
                samples = self._plan(step)
                fetched = self._fetch(samples)
                fill_batch(
                    samples,
                    self._fields,
                    self._grid,
                    self._block,
                    self._sample,
                    self._slots[slot],
                    fetched,
                )
                self._ready.put((step, slot, samples))
        except BaseException as exc:  # handed to the call, which fails with it
            self._ready.put((None, None, exc))
            return
        self._ready.put((None, None, None))

    # -- the call ------------------------------------------------------------------------------
    def mapped(self) -> None:
        """The client has mapped the segment: its file can go (the mappings stay valid)."""
        if self.segment is not None:
            self.segment.close()
        self._mapped.set()

    def done(self, steps: list[int]) -> None:
        """The client no longer reads these steps' regions."""
        for s in steps:
            slot = self._slot_of.pop(int(s), None)
            if slot is not None:
                self._free.put(slot)

    def messages(self) -> Iterator[tuple[Any, int]]:
        """``(Batch, payload bytes)`` in step order, until the end, ``stop`` or an error."""
        self._worker.start()
        try:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    step, slot, samples = self._ready.get(timeout=0.1)
                except queue.Empty:
                    self._on_stall(time.perf_counter() - t0)
                    continue
                self._on_stall(time.perf_counter() - t0)
                if step is None:
                    if samples is not None:
                        raise samples
                    self._until_mapped()
                    return
                yield self._message(step, slot, samples)
        finally:
            self.close()

    def _until_mapped(self, patience_s: float = 30.0) -> None:
        """Before the call ends, let a client that was sent regions map them first (a client
        that never says so gets ``patience_s``)."""
        if self.segment is None or self.end == self.start:
            return
        deadline = time.monotonic() + patience_s
        while not self._mapped.wait(0.1):
            if self.stop.is_set() or time.monotonic() > deadline:
                return

    def _message(self, step: int, slot: int, samples: np.ndarray) -> tuple[Any, int]:
        tensors, nbytes = [], 0
        for f in self._fields:
            arr = self._slots[slot][f.name]
            meta = pb.TensorMeta(
                name=f.name,
                dtype=arr.dtype.str,
                shape=list(arr.shape),
                origin=list(f.origin),
                nbytes=arr.nbytes,
            )
            nbytes += arr.nbytes
            if self.segment is None:
                tensors.append(pb.Tensor(meta=meta, data=arr.tobytes()))
                continue
            region = pb.SharedMemoryRegion(
                path=str(self.segment.path),
                offset=self.segment.offset(slot) + self._at[f.name],
                length=arr.nbytes,
                generation=step,
            )
            tensors.append(pb.Tensor(meta=meta, shm=region))
        if self.segment is None:
            self._free.put(slot)
        else:
            self._slot_of[step] = slot
        batch = pb.Batch(
            epoch=self.epoch,
            step=step,
            rank=self.rank,
            sample_indices=[int(i) for i in samples],
            tensors=tensors,
            last_in_epoch=step == self._steps_per_epoch - 1,
        )
        return batch, nbytes

    def close(self) -> None:
        """Stop producing and remove the segment; safe to call twice, from any thread."""
        self.stop.set()
        if self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join()
        if self.segment is not None:
            self.segment.close()

"""The local source: this rank reads the blocks it needs itself and keeps them in its store.

A region read (HDF5 hyperslab, Zarr slice, npy memmap) fetches only the rank's block of a
sample, plus halo; the part of the box outside the volume is stored as zeros. Later epochs
copy from the store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from datastore.agree import StepSync
from datastore.delivery import Copy, Delivered, Gather, covered
from datastore.order import Schedule
from datastore.ring import Buffer, BufferRing
from datastore.sources.options import StoreOptions
from datastore.store import SlotSpec, Store

__all__ = ["LocalSource", "filled_batches"]


class LocalSource:
    """Blocks of every sample, read by this rank on first use (or ``preload``).

    Args:
        reader: the dataset.
        fields: the fields as this rank receives them.
        store: the store's memory policy and spill directory.
        gather: the batch copies.
        keys: the samples this rank may need. Default: all.
    """

    def __init__(
        self,
        reader: Any,
        fields: list[Delivered],
        store: StoreOptions,
        gather: Gather,
        keys: np.ndarray | None = None,
    ) -> None:
        self.reader, self.gather = reader, gather
        self.fields = {f.name: f for f in fields}
        specs = {f.name: SlotSpec(f.shape, f.dtype) for f in fields}
        keys = np.arange(len(reader)) if keys is None else keys
        self.store = Store(keys, specs, self._read, store.memory_budget, store.spill_dir)

    def _read(self, index: int, name: str, out: np.ndarray) -> None:
        f = self.fields[name]
        src, inner = covered(f)
        if not f.blocked or inner == tuple(slice(0, n) for n in f.shape):
            self.reader.read(index, name, region=src, out=out)
            return
        out.fill(0)
        out[inner] = self.reader.read(index, name, region=src)

    def deliver(self, samples: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Copy ``samples`` (this rank's share of a step) into ``out``."""
        copies: list[Copy] = []
        for pos, index in enumerate(samples.tolist()):
            for name in self.fields:
                copies.append((out[name][pos, ...], self.store.lasting(index, name)))
        self.gather.run(copies)


def filled_batches(
    schedule: Schedule,
    epoch: int,
    start: int,
    stop: threading.Event,
    ring: BufferRing,
    deliver: Any,
    sync: StepSync | None = None,
) -> Iterator[tuple[int, Buffer]]:
    """``(step, buffer)`` of ``epoch`` from ``start``: each step delivered by
    ``deliver(epoch, step, arrays)`` into a buffer of ``ring``. With ``sync`` (an exchange),
    every rank starts at the same position and stops at the same step."""
    if sync is not None:
        sync.start(epoch, start)
    for step in range(start, schedule.steps_per_epoch):
        if sync is not None:
            if sync.halt(step, stop.is_set()):
                return
        elif stop.is_set():
            return
        buf = ring.take()
        try:
            deliver(epoch, step, buf.arrays)
        except BaseException:
            ring.give_back(buf)
            raise
        yield step, buf

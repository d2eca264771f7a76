"""The local source: this rank reads the blocks it needs itself and keeps them in its store.

A region read (HDF5 hyperslab, Zarr slice, npy memmap) fetches only the rank's block of a
sample, plus halo; the part of the box outside the volume is stored as zeros. Later epochs
copy from the store.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from datastore.maths.delivery import Copy, covered
from datastore.maths.rank_view import RankView
from datastore.sources.embedded import EmbeddedSource
from datastore.sources.options import StoreOptions
from datastore.store.gather import Gather
from datastore.store.store import SlotSpec, Store

__all__ = ["LocalSource"]


class LocalSource(EmbeddedSource):
    """Blocks of every sample, read by this rank on first use (or ``preload``).

    Args:
        reader: the dataset.
        view: this rank's view of the job (its schedule, place and fields).
        store: the store's memory policy and spill directory.
        gather: the batch copies.
        keys: the samples this rank may need.
    """

    kind = "local"

    def __init__(
        self, reader: Any, view: RankView, store: StoreOptions, gather: Gather, keys: np.ndarray
    ) -> None:
        self.reader, self.gather = reader, gather
        self.fields = {f.name: f for f in view.fields}
        self.data_rank, self.data_world = view.layout.data_rank, view.layout.data_world
        specs = {f.name: SlotSpec(f.shape, f.dtype) for f in view.fields}
        budget, spill_dir = store.memory_budget, store.spill_dir
        super().__init__(view.schedule, Store(keys, specs, self._read, budget, spill_dir))

    def _read(self, index: int, name: str, out: np.ndarray) -> None:
        f = self.fields[name]
        src, inner = covered(f)
        if not f.blocked or inner == tuple(slice(0, n) for n in f.shape):
            self.reader.read(index, name, region=src, out=out)
            return
        out.fill(0)
        out[inner] = self.reader.read(index, name, region=src)

    def deliver(self, epoch: int, step: int, out: dict[str, np.ndarray]) -> None:
        """Copy this rank's samples of the step into ``out``."""
        samples = self.schedule.rank_samples(epoch, step, self.data_rank, self.data_world)
        copies: list[Copy] = []
        for pos, index in enumerate(samples.tolist()):
            for name in self.fields:
                copies.append((out[name][pos, ...], self.store.lasting(index, name)))
        self.gather.run(copies)

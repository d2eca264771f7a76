"""``DataStoreLoader``: PyTorch batches from the sample store, embedded in the training process.

Iterating yields ``{field: tensor}`` with the batch first. For a spatially decomposed model a
rank receives only its block of each spatial field (plus halo), non-spatial fields whole.

Two ways to get the samples a rank needs, chosen automatically:

- **exchange** (under MPI, more than one rank): every rank owns a contiguous 1/R of the
  samples, read once (``preload``) into its store; at every step the owners send each consumer
  exactly the blocks it needs (``datastore.exchange``), prefetched ahead from the known order.
  The dataset is held once across the job.
- **local** (one rank, or no MPI): the rank reads the blocks it needs directly (a region read:
  HDF5 hyperslab, Zarr slice, npy memmap) and keeps them in its store for later epochs.

A background thread prepares ``prefetch`` batches ahead into a ring of reused buffers: a
batch's tensors stay valid until ``prefetch + 1`` further batches have been drawn (call
``.clone()`` to keep one longer).
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from datastore.exchange import Exchange, Part
from datastore.order import EpochPosition, Schedule, contiguous_owners, rank_layout
from datastore.partition import Grid, extract_block, full_region
from datastore.readers import open_dataset
from datastore.shards import shard_layout
from datastore.store import Counters, SlotSpec, Store
from datastore.world import detect_world

__all__ = ["DataStoreLoader"]


@dataclass(frozen=True)
class _Field:
    """How one field is delivered: full ``sample_shape``, or block ``shape`` of it."""

    name: str
    dtype: np.dtype
    sample_shape: tuple[int, ...]
    spatial_axes: tuple[int, ...]
    shape: tuple[int, ...]  # per sample, as delivered to this rank
    region: tuple[slice, ...]  # what to read of a sample for this rank's block
    pad: tuple[tuple[int, int], ...]  # zero padding around what was read


def _root(dataset: Any) -> str:
    """The directory that sample file names are taken relative to."""
    path = dataset if isinstance(dataset, str) else dataset.paths[0]
    return path if os.path.isdir(path) else os.path.dirname(path)


def _offer(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    """Put ``item`` unless the consumer has stopped: never block on a queue nobody drains."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


class DataStoreLoader(EpochPosition):
    """Mini-batches for one rank of a data (x spatial) parallel job.

    Args:
        dataset: a path (format auto-detected) or a ``DatasetSpec``.
        batch_size: samples per step on this rank (PyTorch's meaning); or give
            ``global_batch_size`` instead, the samples per step over all data-parallel ranks.
        fields: fields to deliver. Default: all.
        seed: shuffle seed, the same on every rank. Default: ``0``.
        shuffle: a new permutation every epoch. Default: ``True``.
        drop_last: drop the last partial global batch (else pad it with the epoch's first
            samples); every rank gets the same number of batches either way. Default: ``True``.
        spatial: ``{"parts": (2, 1, 1), "halo": (1, 1, 1), "boundary": "zero"}``: deliver each
            rank its block of every spatial field. Ranks are spatial-fastest:
            ``rank = data_rank * blocks + block``. Default: ``None`` (whole samples).
        rank, world: this rank and the world size; default from torch.distributed, an MPI
            launcher, torchrun or Slurm variables (``datastore.world``).
        comm: an mpi4py communicator to exchange over. Default: ``COMM_WORLD`` under MPI.
        exchange: force (``True``) or forbid (``False``) the MPI exchange. Default: automatic.
        preload: read the rank's samples when created, not on first use. Default: ``True``.
        memory_budget: bytes of RAM for the store; beyond it slots spill to ``spill_dir`` or
            are re-read. Default: ``None`` (no limit).
        spill_dir: where the store spills. Default: ``None``.
        prefetch: batches prepared ahead. Default: ``2``.
        pin_memory: page-locked batch buffers (CUDA only; ignored with a note otherwise).
        timeout: seconds to wait for a batch before failing (a peer rank may have died).
            Default: ``300``.
        address: stream the batches from ``datastore serve`` at this Unix socket path (or
            ``unix://PATH``, ``HOST:PORT``) instead of reading here: the constructor then
            returns a ``datastore.service.client.RemoteLoader`` with the same iteration API.
            Default: ``None``: ``DATASTORE_ADDRESS`` if set and not empty, else embedded.
    """

    def __new__(cls, *args: Any, address: str | None = None, **kwargs: Any) -> Any:
        if address is None:
            address = os.environ.get("DATASTORE_ADDRESS") or None
        if address is None:
            return super().__new__(cls)
        from datastore.service.client import RemoteLoader

        return RemoteLoader(*args, address=address, **kwargs)

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = None,
        *,
        global_batch_size: int | None = None,
        fields: list[str] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        spatial: dict[str, Any] | None = None,
        rank: int | None = None,
        world: int | None = None,
        comm: Any = None,
        exchange: bool | None = None,
        preload: bool = True,
        memory_budget: int | None = None,
        spill_dir: str | None = None,
        prefetch: int = 2,
        pin_memory: bool = False,
        timeout: float = 300.0,
        address: str | None = None,
    ):
        self.reader = open_dataset(dataset)
        self.world = detect_world(rank, world, comm)
        multi = self.world.comm is not None and self.world.size > 1
        if exchange and not multi:
            raise ValueError("exchange=True needs an MPI communicator with more than one rank")
        self.exchanging = multi if exchange is None else exchange
        owner = None
        if self.exchanging:
            owner = contiguous_owners(len(self.reader), self.world.size)
            sharded = shard_layout(self.reader, _root(dataset), self.world.comm)
            if sharded is not None:  # each node holds its share (datastore stage --mode shard)
                self.reader, owner = sharded
        self.fields = self._fields(fields, spatial)
        nblocks = self._grid.nblocks if self._grid is not None else 1
        self.layout = rank_layout(self.world.rank, self.world.size, nblocks)
        dw = self.layout.data_world
        if (batch_size is None) == (global_batch_size is None):
            raise ValueError("give exactly one of batch_size (per rank) and global_batch_size")
        gb = global_batch_size if global_batch_size is not None else batch_size * dw
        tail = "drop" if drop_last else "pad"
        self.schedule = Schedule(len(self.reader), gb, seed, shuffle, tail)
        self.batch_size = self.schedule.local_batch(dw)
        self.prefetch, self.timeout = max(1, prefetch), timeout
        self.epoch, self._step = 0, 0
        self._exchange: Exchange | None = None
        if owner is not None:
            keys = np.flatnonzero(owner == self.world.rank)
            specs = {f.name: SlotSpec(f.sample_shape, f.dtype) for f in self.fields}
            self.store = Store(keys, specs, self._read_sample, memory_budget, spill_dir)
            self._exchange = Exchange(
                self.world.comm, owner, dw, nblocks, self._sources, self._targets, self._local
            )
        else:
            keys = np.arange(len(self.reader))
            specs = {f.name: SlotSpec(f.shape, f.dtype) for f in self.fields}
            self.store = Store(keys, specs, self._read_block, memory_budget, spill_dir)
        if preload:
            self.store.preload()
        self._ring = [self._batch_buffers(pin_memory) for _ in range(self.prefetch + 2)]
        self._filling: dict[str, np.ndarray] = {}

    # -- layout ------------------------------------------------------------------------------
    def _fields(self, names: list[str] | None, spatial: dict[str, Any] | None) -> list[_Field]:
        info = self.reader.fields
        names = list(info) if names is None else names
        for n in names:
            if n not in info:
                raise ValueError(f"no field {n!r} in the dataset (it has {', '.join(info)})")
        self._grid = None
        out = []
        for n in names:
            fi = info[n]
            shape, axes = tuple(fi.shape), tuple(fi.spatial_axes)
            region = tuple(slice(0, s) for s in shape)
            pad = tuple((0, 0) for _ in shape)
            delivered = shape
            if spatial and axes:
                vol = tuple(shape[a] for a in axes)
                grid = Grid(
                    vol,
                    tuple(spatial["parts"]),
                    tuple(spatial.get("halo", ())),
                    spatial.get("boundary", "zero"),
                )
                if self._grid is not None and self._grid.shape != vol:
                    raise ValueError(
                        f"spatial field {n!r} has shape {vol}, others {self._grid.shape}"
                    )
                self._grid = grid
            out.append(_Field(n, np.dtype(fi.dtype), shape, axes, delivered, region, pad))
        if spatial and self._grid is None:
            raise ValueError("spatial= was given but no delivered field has spatial axes")
        if self._grid is None:
            return out
        k = self.world.rank % self._grid.nblocks
        return [self._blocked(f, k) if f.spatial_axes else f for f in out]

    def _blocked(self, f: _Field, k: int) -> _Field:
        region, pad = full_region(self._grid, k, len(f.sample_shape), f.spatial_axes)
        region = tuple(  # explicit bounds on every axis (full_region leaves non-spatial open)
            slice(*r.indices(n)[:2]) for r, n in zip(region, f.sample_shape, strict=True)
        )
        shape = tuple(s.stop - s.start + a + b for s, (a, b) in zip(region, pad, strict=True))
        return _Field(f.name, f.dtype, f.sample_shape, f.spatial_axes, shape, region, pad)

    def _for_block(self, f: _Field, k: int) -> _Field:
        return self._blocked(f, k) if (self._grid is not None and f.spatial_axes) else f

    # -- reading -----------------------------------------------------------------------------
    def _read_sample(self, index: int, name: str, out: np.ndarray) -> None:
        self.reader.read(index, name, out=out)

    def _read_block(self, index: int, name: str, out: np.ndarray) -> None:
        f = next(x for x in self.fields if x.name == name)
        if not any(a or b for a, b in f.pad):
            self.reader.read(index, name, region=f.region, out=out)
            return
        out.fill(0)
        inner = tuple(
            slice(a, a + s.stop - s.start) for s, (a, _) in zip(f.region, f.pad, strict=True)
        )
        out[inner] = self.reader.read(index, name, region=f.region)

    # -- exchange callbacks --------------------------------------------------------------------
    def _sources(self, sample: int, k: int) -> list[Part]:
        parts = []
        for f in self.fields:
            vol = self.store.get(sample, f.name)
            if not self.store.resident(sample):
                vol = vol.copy()  # a re-read scratch array must outlive the non-blocking send
            fk = self._for_block(f, k)
            starts = tuple(r.start for r in fk.region)
            parts.append(Part(vol, starts, tuple(r.stop - r.start for r in fk.region)))
        return parts

    def _targets(self, pos: int) -> list[Part]:
        return [
            Part(
                self._filling[f.name][pos, ...],
                tuple(a for a, _ in f.pad),
                tuple(r.stop - r.start for r in f.region),
            )
            for f in self.fields
        ]

    def _local(self, sample: int, k: int, pos: int) -> None:
        for f in self.fields:
            vol, dst = self.store.get(sample, f.name), self._filling[f.name][pos, ...]
            if self._grid is not None and f.spatial_axes:
                extract_block(vol, self._grid, k, f.spatial_axes, out=dst)
            else:
                dst[...] = vol

    # -- batches -------------------------------------------------------------------------------
    def _batch_buffers(self, pin: bool) -> dict[str, np.ndarray]:
        if pin and not torch.cuda.is_available():
            print("datastore: note: pin_memory needs CUDA; using pageable memory", file=sys.stderr)
            pin = False
        out = {}
        for f in self.fields:
            t = torch.zeros(  # zeroed once: halo outside the volume is never written again
                (self.batch_size, *f.shape),
                dtype=torch.from_numpy(np.empty(0, f.dtype)).dtype,
                pin_memory=pin,
            )
            out[f.name] = t.numpy()
        return out

    def _fill(self, step: int, order: np.ndarray, buf: dict[str, np.ndarray]) -> None:
        g = self.schedule.global_batch_at(self.epoch, step, order)
        if self._exchange is not None:
            self._filling = buf
            self._exchange.step(g)
            return
        mine = self.schedule.rank_batch(g, self.layout.data_rank, self.layout.data_world)
        for pos, sample in enumerate(mine.tolist()):
            for f in self.fields:
                buf[f.name][pos] = self.store.get(sample, f.name)

    def _produce(self, start: int, q: queue.Queue, stop: threading.Event) -> None:
        try:
            order = self.schedule.order(self.epoch)
            for step in range(start, self.schedule.steps_per_epoch):
                halt = stop.is_set()
                if self._exchange is not None:
                    halt = self._exchange.agree_to_stop(halt)
                if halt:
                    break
                buf = self._ring[step % len(self._ring)]
                self._fill(step, order, buf)
                _offer(q, (step, buf), stop)
        except BaseException as exc:  # handed to the consumer, which raises it
            _offer(q, (None, exc), stop)
            return
        _offer(q, (None, None), stop)

    def __iter__(self):
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        start = self._step
        worker = threading.Thread(
            target=self._produce, args=(start, q, stop), daemon=True, name="datastore-prefetch"
        )
        worker.start()
        finished = False
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    step, item = q.get(timeout=self.timeout)
                except queue.Empty:
                    raise RuntimeError(
                        f"no batch within {self.timeout:.0f} s (rank {self.world.rank}): "
                        "a peer rank may have failed"
                    ) from None
                self.store.counters.wait_seconds += time.perf_counter() - t0
                if step is None:
                    if item is not None:
                        raise item
                    finished = True
                    return
                self._step = step + 1
                yield {name: torch.from_numpy(arr) for name, arr in item.items()}
        finally:
            stop.set()
            worker.join()
            self._end_iteration(finished)

    @property
    def counters(self) -> Counters:
        c = self.store.counters
        if self._exchange is not None:
            c.bytes_exchanged = self._exchange.bytes_sent
            c.exchange_seconds = self._exchange.seconds
        return c

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
            self._exchange = None
        self.store.close()
        self.reader.close()

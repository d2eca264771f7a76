"""``DataStoreLoader``: PyTorch batches for one rank of a data (x spatial) parallel job.

One front end over three sources (``datastore.sources``): the rank's own reads (local), an
exchange between the ranks that hold the dataset once between them (MPI, or
``torch.distributed`` under torchrun), or ``datastore serve`` (``service=``). The loader checks
its arguments once, on every rank alike; owns the position in the sample sequence
(``datastore.maths.order``), the batch buffers (``datastore.store.ring``), the prefetch thread and
the device stage (``datastore.store.device``); each source only fills the buffers it is given.

A background thread prepares ``prefetch`` batches ahead: the source fills a buffer (copies
spread over ``threads`` threads) and the batch is copied to ``device`` on a side stream; the
consumer takes it and runs ``transform`` on it in its own thread (so that the transform's draws
from torch's generator come in the loop's order, as with ``DataLoader(num_workers=0)``).
Tensors handed out view the loader's buffers (no copy) and are never overwritten while anyone
holds them.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import math
import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from datastore.errors import ExchangeTimeout, InsufficientMemory
from datastore.maths.delivery import (
    Delivered,
    chosen_fields,
    parse_spatial,
)
from datastore.maths.order import EpochPosition, RankLayout, parse_shuffle
from datastore.maths.ownership import RangeOwners, RunOwners, owned_keys
from datastore.maths.rank_view import RankView, rank_view
from datastore.ranks.agree import Collective, StepSync, StoreCollective, agree
from datastore.ranks.world import World, detect_world
from datastore.readers import open_dataset
from datastore.readers.identity import identity
from datastore.sources.embedded import EmbeddedSource, ExchangeSource
from datastore.sources.local import LocalSource
from datastore.sources.options import (
    ExchangeOptions,
    ServiceOptions,
    StoreOptions,
    check_options,
    moved_keywords,
    service_of,
)
from datastore.sources.owners import ExchangeSetup
from datastore.sources.torch_dist import keeps_group
from datastore.store.device import DeviceStage, parse_device
from datastore.store.gather import Gather
from datastore.store.memory import available_memory
from datastore.store.ring import BufferRing, can_pin, staging_pinned
from datastore.store.shards import shard_layout
from datastore.store.store import Counters, SlotSpec, Store

__all__ = ["VALID", "DataStoreLoader", "LoaderDataset", "LoaderOptions", "LoaderSampler"]

VALID = "valid"  # the key of the mask of real samples when drop_last=False
# the arguments that fix which samples each rank receives at every step (``rank_view``'s)
ORDER_KEYS = ("batch_size", "global_batch_size", "seed", "shuffle", "drop_last", "spatial")


@dataclass(frozen=True)
class LoaderOptions:
    """The loader's arguments that every source shares, checked (``ValueError``) and
    normalised; see :class:`DataStoreLoader` for their meaning."""

    batch_size: int | None
    global_batch_size: int | None
    fields: tuple[str, ...] | None
    seed: int
    shuffle: str
    drop_last: bool
    spatial: dict[str, Any] | None
    prefetch: int
    pin_memory: bool
    device: torch.device | None
    threads: int | None
    timeout: float
    store: StoreOptions
    exchange: ExchangeOptions

    @classmethod
    def of(cls, **kw: Any) -> LoaderOptions:
        if (kw["batch_size"] is None) == (kw["global_batch_size"] is None):
            raise ValueError("give exactly one of batch_size (per rank) and global_batch_size")
        for name in ("batch_size", "global_batch_size"):
            v = kw[name]
            if v is not None and not _whole(v):
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        fields = _field_names(kw["fields"])
        seed = kw["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not 0 <= seed < 2**64:  # (the service's wire and the trainer take no other)
            raise ValueError(f"seed must be between 0 and 2**64 - 1, got {seed}")
        for name in ("drop_last", "pin_memory"):
            if not isinstance(kw[name], bool | np.bool_):
                raise ValueError(f"{name} must be True or False, got {kw[name]!r}")
        if not _whole(kw["prefetch"]):
            raise ValueError(f"prefetch must be an int >= 1, got {kw['prefetch']!r}")
        if kw["threads"] is not None and not _whole(kw["threads"]):
            raise ValueError(f"threads must be an int >= 1, got {kw['threads']!r}")
        timeout = kw["timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, int | float | np.number):
            raise ValueError(f"timeout must be a number of seconds, got {timeout!r}")
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be > 0 seconds and finite, got {timeout!r}")
        device = parse_device(kw["device"])
        return cls(
            **{
                **kw,
                "fields": fields,
                "seed": int(kw["seed"]),
                "shuffle": parse_shuffle(kw["shuffle"]),
                "spatial": parse_spatial(kw["spatial"]),
                "device": None if device is None or device.type == "cpu" else device,
                "timeout": float(kw["timeout"]),
            }
        )

    def view(
        self, info: dict[str, Any], num_samples: int, world: World, owner: RunOwners | None = None
    ) -> RankView:
        """The view these options give this rank of ``world`` on a dataset of ``num_samples``
        samples with the delivered fields ``info``
        (:func:`~datastore.maths.rank_view.rank_view`)."""
        order = {k: getattr(self, k) for k in ORDER_KEYS}
        return rank_view(info, num_samples, rank=world.rank, world=world.size, owner=owner, **order)

    def fingerprint(self) -> dict[str, str]:
        """What must be the same on every rank of a job."""
        order = {k: repr(getattr(self, k)) for k in ORDER_KEYS}
        return {**order, "fields": repr(self.fields), "exchange": repr(self.exchange.enabled)}


def _whole(v: Any) -> bool:
    """An int >= 1 (a bool is not: ``prefetch=True`` would be 1, less than the default)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _field_names(fields: Any) -> tuple[str, ...] | None:
    """``fields=`` as a tuple of distinct names (``None``: every field), the same check for
    every source."""
    if fields is None:
        return None
    if isinstance(fields, str):
        raise ValueError(f"fields must be a list of names, got the string {fields!r}")
    try:
        names = tuple(fields)
    except TypeError:
        raise ValueError(f"fields must be a list of names, got {fields!r}") from None
    if not names:
        raise ValueError("fields=[] names no field: name at least one, or None for all")
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"fields must be a list of names, got {name!r} in {fields!r}")
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"fields names {name!r} twice: name each field once")
    return names


def _raw_fingerprint(kw: dict[str, Any]) -> dict[str, str]:
    """The fingerprint of arguments that did not pass the checks (so every rank still agrees
    on which rank refused)."""
    order = {k: repr(kw[k]) for k in ORDER_KEYS}
    return {**order, "fields": repr(kw["fields"]), "exchange": "?"}


STUCK_WAIT_S = 1.0  # how long a producer that gave nothing within the timeout is waited for
NAMING_WAIT_S = 5.0  # past the timeout, for the producer's own error (which names the peer)
CLOSED = "this loader is closed (close(), or the end of its with block): make a new one"
EXIT_WAIT_S = 5.0  # how long the prefetch threads still running at exit are waited for, in all
_PREFETCHING: set[tuple[threading.Thread, threading.Event]] = set()  # (thread, its stop)


@atexit.register
def _stop_prefetching() -> None:
    """Stop the prefetch threads of passes still open at exit (an iterator kept after a peek,
    an exception out of a list comprehension), before the interpreter ends its daemon threads
    where they stand: one ended inside a torch call aborts the process (``terminate called
    without an active exception``, exit 134)."""
    live = list(_PREFETCHING)
    for _, stop in live:
        stop.set()
    end = time.monotonic() + EXIT_WAIT_S
    for worker, _ in live:
        worker.join(max(0.0, end - time.monotonic()))


def _offer(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item`` unless the consumer has stopped: never block on a queue nobody drains."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


class DataStoreLoader(EpochPosition):
    """Mini-batches for one rank of a data (x spatial) parallel job.

    Args:
        dataset: a path (format auto-detected) or a ``DatasetSpec``.
        layout: for a path of HDF5 files: ``"shards"`` (a leading sample axis in each file)
            or ``"per-sample"`` (one sample per file). Default: ``None``, decided from the
            files; files of identical shapes whose datasets share a leading length are
            refused without it (``readers.spec.detect``).
        batch_size: samples per step on this rank (PyTorch's meaning); or give
            ``global_batch_size`` instead, the samples per step over all data-parallel ranks.
        fields: fields to deliver; with a path, the others are not read or checked (an xarray
            file's coordinate arrays, of other lengths, may stay beside them). Default: all.
        seed: shuffle seed, the same on every rank (0 to ``2**64 - 1``). Default: ``0``.
        shuffle: the order of every epoch (``datastore.maths.order``). ``"global"`` (or ``True``):
            a new permutation of the whole dataset, the same for any world size.
            ``"shard"``: each data rank draws a permutation of the samples its own ranks
            hold, so no sample crosses between data ranks (the local source reads only its
            share). ``"window:K"``: the same samples read in shuffled windows of ``K``
            consecutive ones, shuffled within (a streaming loader's shuffle buffer).
            ``"none"`` (or ``False``): storage order. Through ``service=`` each data rank's
            share is its contiguous range of the dataset. Default: ``True``.
        drop_last: drop the last partial global batch, else pad it with the epoch's first
            samples and add ``batch["valid"]``, a bool tensor that is ``False`` for the
            padding repeats. Every rank gets the same number of batches. Default: ``True``.
        spatial: ``{"parts": (2, 1, 1), "halo": 1, "boundary": "zero"}``: deliver each rank
            its block of every spatial field (``halo``: one width, or one per axis). Ranks
            are spatial-fastest: ``rank = data_rank * blocks + block``. Default: ``None``.
        rank, world: this rank and the world size. Default: from the launcher
            (``datastore.ranks.world``); under an MPI launcher the exchange runs over MPI even when
            they are given or ``torch.distributed`` is initialized.
        prefetch: batches prepared ahead. Default: ``2``.
        pin_memory: page-locked batches, for the consumer's ``.cuda(non_blocking=True)``
            (CUDA only; ignored with a warning otherwise). Each batch is new memory from
            torch's caching host allocator, reused once the copies from it are done (as
            torch's ``DataLoader``). Default: ``False``.
        device: ``"cuda"``, ``"cuda:1"``, a ``torch.device``: batches arrive as tensors on
            that device, copied from pinned buffers (whatever ``pin_memory`` says) on a side
            stream. Default: ``None``.
        threads: threads copying each batch. Default: the cores this rank may use, up to 16.
        transform: ``transform(batch) -> batch`` on every batch, after the rank's block is
            cut; on the device when ``device`` is set (on the current stream), in the thread
            that iterates, as ``DataLoader(num_workers=0)`` runs it: its random draws are
            reproducible under ``torch.manual_seed``. Default: none.
        collate: ``collate(batch) -> anything``: what iteration yields. Default: the batch.
        timeout: seconds to wait for peers or the service before failing with an error
            naming the step and the peer. Default: ``300``.
        store: the embedded store's settings (preload, memory budget, spill directory):
            a :class:`~datastore.sources.options.StoreOptions`. Default: ``StoreOptions()``.
        exchange: the exchange's settings (forced or forbidden, the communicator or group):
            an :class:`~datastore.sources.options.ExchangeOptions`. Default: automatic.
        service: stream from ``datastore serve`` instead of the embedded store: a
            :class:`~datastore.sources.options.ServiceOptions` (address, token, transport,
            job id, TLS CA). Default: one at ``$DATASTORE_ADDRESS`` if set, else embedded.

    Attributes:
        source: where batches come from: ``"local"``, ``"mpi"``, ``"torch.distributed"``
            (an exchange between the ranks) or ``"service"``.
        sampler: whose ``set_epoch`` trainers call (Lightning), the loader's; its ``len`` is
            the samples this rank gets per epoch, as a ``DistributedSampler``'s.

    Every ``iter()`` is a whole pass, as with torch's loaders; only the first after
    ``load_state_dict`` resumes mid-epoch (``datastore.maths.order.EpochPosition``).

    Raises:
        TypeError: an unknown keyword argument, or a settings object of the wrong class.
        ValueError: a bad argument (every rank raises alike); ``RankMismatch`` when ranks
            disagree on arguments or the dataset.
        DatasetNotFound, PathNotAllowed, ServiceUnavailable: see ``datastore.errors``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = None,
        *,
        global_batch_size: int | None = None,
        fields: list[str] | None = None,
        seed: int = 0,
        shuffle: bool | str = True,
        drop_last: bool = True,
        spatial: dict[str, Any] | None = None,
        rank: int | None = None,
        world: int | None = None,
        layout: str | None = None,
        prefetch: int = 2,
        pin_memory: bool = False,
        device: Any = None,
        threads: int | None = None,
        transform: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        collate: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        timeout: float = 300.0,
        store: StoreOptions | None = None,
        exchange: ExchangeOptions | None = None,
        service: ServiceOptions | None = None,
        **moved: Any,
    ):
        if moved:  # a keyword of before the settings objects: say where it went
            raise TypeError(moved_keywords(sorted(moved)))
        check_options("store", store, StoreOptions)
        check_options("exchange", exchange, ExchangeOptions)
        check_options("service", service, ServiceOptions)
        given_store, service = store is not None, service_of(service)
        store, exchange = store or StoreOptions(), exchange or ExchangeOptions()
        kw = {
            "batch_size": batch_size,
            "global_batch_size": global_batch_size,
            "fields": fields,
            "seed": seed,
            "shuffle": shuffle,
            "drop_last": drop_last,
            "spatial": spatial,
            "prefetch": prefetch,
            "pin_memory": pin_memory,
            "device": device,
            "threads": threads,
            "timeout": timeout,
            "store": store,
            "exchange": exchange,
        }
        self.transform, self.collate = transform, collate
        remote = service is not None
        self.world: World = detect_world(rank, world, exchange.comm, group=exchange.group)
        self._checks: StoreCollective | None = None  # the checks' ranks, without an exchange
        self._unchecked: dict[str, str] | None = None  # what the first pass must agree on
        self._coll = self._collective(exchange.group, exchange.enabled, remote)
        error: BaseException | None = None
        self.options: LoaderOptions | None = None
        try:
            self.options = LoaderOptions.of(**kw)
            for name, hook in (("transform", transform), ("collate", collate)):
                if hook is not None and not callable(hook):
                    raise TypeError(f"{name} must be a function of the batch, got {hook!r}")
            if remote and layout is not None:
                raise ValueError(
                    "layout= is for the embedded store: with service=, name a spec file "
                    '(format = "hdf5" or "hdf5-per-sample") as the dataset'
                )
            if remote and given_store:
                raise ValueError(
                    "store= is for the embedded store: with service=, the service holds the "
                    "dataset (its memory is set by datastore serve)"
                )
        except (ValueError, TypeError) as exc:
            error = exc
        self._broken: str | None = None
        reader = None
        if not remote and error is None:
            try:  # the fields asked for: others (an xarray file's coordinates) are not checked
                reader = open_dataset(dataset, layout=layout, fields=self.options.fields or ())
            except (OSError, ValueError) as exc:  # a missing path is a DatasetNotFound
                error = exc
        self._agree(_raw_fingerprint(kw) if error else self.options.fingerprint(), error)
        o = self.options
        self.gather = Gather(o.threads)
        self._stage = DeviceStage(o.device) if o.device is not None else None
        if remote:
            self._source: Any = self._open_service(dataset, service)
            self.source = "service"
        else:
            self._source = self._open_embedded(dataset, reader)
            self.source = self._source.kind
        self.epoch, self._step = 0, 0
        self._waited = 0.0  # seconds the consumer waited for batches
        # the prefetch threads of live passes, and what stops each
        self._workers: list[tuple[threading.Thread, threading.Event]] = []
        self._closed = False
        pin = can_pin(staging_pinned(o.pin_memory, o.device))  # without CUDA: a note, once
        # pinned batches handed out are copied by the consumer, out of the ring's sight
        fresh = pin and self._stage is None
        self.ring = BufferRing(self.fields, self.batch_size, o.prefetch + 2, pin, fresh)

    # -- set-up ---------------------------------------------------------------------------------
    def _collective(self, group: Any, exchange: bool | None, remote: bool) -> Collective | None:
        """The ranks' collective: MPI when launched by it, else ``torch.distributed``
        (``None``: one rank, no exchange, or neither is there)."""
        if self.world.size < 2 or exchange is False:
            return None
        if self.world.comm is not None:
            return Collective(comm=self.world.comm)
        import torch.distributed as dist

        own_job = False  # rank=/world= of a job inside the process group's (as under MPI)
        if dist.is_available() and dist.is_initialized():
            own_job = not self._group_numbers_the_world(dist, group)
        if own_job and exchange:
            raise ValueError(
                f"exchange=True, but world={self.world.size} was given and the "
                f"torch.distributed group has {dist.get_world_size()} ranks: pass "
                "ExchangeOptions(group=...) holding the ranks of this job"
            )
        if dist.is_available() and dist.is_initialized() and not own_job:
            from datastore.sources.torch_dist import gloo_group

            return Collective(group=gloo_group(group))
        if exchange:
            raise ValueError(
                "exchange=True needs an MPI launcher or an initialized torch.distributed group"
            )
        if remote:  # the service holds the dataset: nothing to exchange, nothing to check with
            warnings.warn(
                f"datastore: {self.world.size} ranks ({self.world.source}) but no MPI and no "
                "torch.distributed process group: the ranks cannot check that they agree on "
                "the seed, the batch and the shuffle, and ranks that differ get overlapping "
                "samples silently. Launch with mpiexec, or call "
                "torch.distributed.init_process_group first, to have them checked.",
                UserWarning,
                stacklevel=3,
            )
            return None
        self._checks = StoreCollective.of(self.world.rank, self.world.size, os.environ)
        if self._checks is None and self.world.source != "given":
            self._unchecked = {}  # agreed at the first pass, over the process group made by then
        if own_job:
            warnings.warn(
                f"datastore: rank={self.world.rank}, world={self.world.size} given, but the "
                f"torch.distributed group has {dist.get_world_size()} ranks: taken as a job of "
                "its own, every rank reads and holds the samples it needs itself. Pass "
                "ExchangeOptions(group=...) with the group of this job's ranks (a data-parallel "
                "group) to hold the dataset once between them.",
                UserWarning,
                stacklevel=3,
            )
            return None
        warnings.warn(
            f"datastore: {self.world.size} ranks ({self.world.source}) but no MPI and no "
            "torch.distributed process group: every rank reads and holds the samples it needs "
            "itself. Call torch.distributed.init_process_group first (or launch with mpiexec) "
            "to hold the dataset once between the ranks.",
            UserWarning,
            stacklevel=3,
        )
        return None

    def _group_numbers_the_world(self, dist: Any, group: Any) -> bool:
        """Whether the exchange's group (``group``, else the default one) numbers the ranks as
        ``self.world`` does. Given ``rank``/``world`` of another size than the default group's
        are a job of its own (``False``: no exchange, as under MPI); a rank numbered otherwise,
        or a given group of another size, is a ``ValueError`` naming both."""
        w = self.world
        size, me = dist.get_world_size(group), dist.get_rank(group)
        if (size, me) == (w.size, w.rank):
            return True
        if group is None and w.source == "given" and size != w.size:
            return False
        what = "ExchangeOptions.group" if group is not None else "the torch.distributed group"
        raise ValueError(
            f"{what} numbers this rank {me} of {size}, but the loader is rank {w.rank} of "
            f"{w.size} ({w.source}): the exchange's ranks must be numbered as the group numbers "
            "them (give rank=/world= as the group's, or a group of this job's ranks)"
        )

    def _agree(
        self, fingerprint: dict[str, str], error: BaseException | None, doing: str | None = None
    ) -> None:
        """Raise ``error`` (or a peer's, or a disagreement) on every rank alike; with ``doing``
        a peer's error is a ``PeerFailed`` saying it failed ``doing`` so."""
        timeout = self.options.timeout if self.options is not None else 300.0
        coll = self._coll or self._checks
        if coll is not None:
            agree(coll, fingerprint, error, timeout, doing=doing)
        elif error is not None:
            raise error
        elif self._unchecked is not None:
            self._unchecked.update(fingerprint)

    def _check_late(self) -> None:
        """The start-up check of a loader made before the process group and without
        torchrun's store: at its first pass, over the group made by then, or refused."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            w = self.world
            raise RuntimeError(
                f"{w.size} ranks ({w.source}) but no MPI, no torch.distributed process group "
                "and no torchrun store: the ranks cannot check that they agree on the seed and "
                "the dataset (a seed that differs between ranks loses samples silently). Call "
                "torch.distributed.init_process_group before the first pass, or launch with "
                "torchrun or mpiexec"
            )
        from datastore.sources.torch_dist import gloo_group

        coll = Collective(group=gloo_group())
        try:
            agree(coll, self._unchecked, None, self.options.timeout, "the first pass's check")
        finally:
            dist.destroy_process_group(coll.group)
        self._unchecked = None

    def _view(self, info: dict[str, Any], owner: RunOwners | None) -> RankView:
        view = self.options.view(info, len(self.reader), self.world, owner)
        if not self.options.drop_last and VALID in info:
            raise ValueError(
                f"the dataset has a field named {VALID!r}, the key of the padding mask with "
                "drop_last=False: leave it out with fields=[...] or use drop_last=True"
            )
        return view

    def _open_embedded(self, dataset: Any, reader: Any) -> EmbeddedSource:
        """The store of this process (local reads, or an exchange over ``self._coll``)."""
        o = self.options
        self.reader = reader
        exchanging = self._coll is not None
        owner = None
        if exchanging:
            # O(ranks), not O(samples); a data rank's ranks hold its contiguous home
            owner = RangeOwners(len(reader), self.world.size, _data_world(o, self.world.size))
            sharded = shard_layout(reader, _root(dataset), self._coll)
            if sharded is not None:  # each node holds its share (datastore stage --mode shard)
                self.reader, owner = sharded
        files = identity(reader.files)
        if self.reader is not reader:  # the data is every node's share
            every = " ".join(self._coll.allgather(files)).encode()
            files = hashlib.blake2b(every, digest_size=8).hexdigest()
        self._data_id = {"location": _name(dataset, reader.location), "identity": files}
        error: BaseException | None = None
        try:
            if not len(self.reader):
                raise ValueError(f"{reader.location}: the dataset has no samples")
            try:  # (fields=[] refused earlier)
                info = chosen_fields(self.reader.fields, o.fields)
            except ValueError as exc:  # named the field, not the file
                raise ValueError(f"{reader.location}: {exc}") from None
            view = self._view(info, owner)
            grid, layout, schedule = view.grid, view.layout, view.schedule
            mine = list(view.fields)
            if owner is not None:
                keys = owned_keys(owner, self.world.rank)
                per_key = sum(
                    int(np.prod(fi.shape)) * np.dtype(fi.dtype).itemsize for fi in info.values()
                )
            elif schedule.homes is not None:  # only this rank's home
                keys = schedule.homes.keys_of(layout.data_rank)
                per_key = sum(f.nbytes for f in mine)
            else:
                keys = np.arange(len(self.reader))
                per_key = sum(f.nbytes for f in mine)
            self._check_memory(len(keys) * per_key)
        except (ValueError, MemoryError) as exc:
            error = exc
        signature = {n: (str(fi.dtype), tuple(fi.shape)) for n, fi in self.reader.fields.items()}
        self._agree({"dataset": f"{len(self.reader)} samples, fields {signature}"}, error)
        self.grid, self.layout, self.schedule = grid, layout, schedule
        self.fields: list[Delivered] = mine
        self.batch_size = view.local_batch
        if owner is None:
            source: EmbeddedSource = LocalSource(self.reader, view, o.store, self.gather, keys)
        else:
            specs = {n: SlotSpec(tuple(fi.shape), np.dtype(fi.dtype)) for n, fi in info.items()}
            store = Store(keys, specs, self._read_sample, o.store.memory_budget, o.store.spill_dir)
            by_block = {k: view.fields_of(k) for k in range(layout.spatial_size)}
            ex = self._make_exchange(owner, layout, by_block, store)
            source = ExchangeSource(schedule, layout, keys, ex, StepSync(self._coll, o.timeout))
        if o.store.preload:
            self._preload(source.store)
        return source

    def _preload(self, store: Store) -> None:
        """Read this rank's samples now. A rank that cannot tells the others, and every rank
        raises (its error, or one naming it): they would wait for its blocks until the timeout."""
        error: Exception | None = None
        try:
            store.preload(threads=max(4, self.gather.threads))
        except Exception as exc:
            error = exc
        try:
            self._agree({}, error, "while reading its samples (preload), before the first step")
        except ExchangeTimeout:
            if error is None:
                raise
            raise error from None

    def _make_exchange(
        self, owner: RunOwners, layout: RankLayout, by_block: dict, store: Store
    ) -> Any:
        setup = ExchangeSetup(
            owner, layout.data_world, layout.spatial_size, store, by_block, self.gather,
            self.options.timeout,
        )  # fmt: skip
        if self._coll.comm is not None:
            from datastore.sources.mpi import MpiExchange

            return MpiExchange(self._coll.comm, setup)
        from datastore.sources.torch_dist import TorchExchange

        return TorchExchange(self._coll.group, setup)

    def _check_memory(self, need: int) -> None:
        """Refuse, before reading, a store larger than the memory this process can use."""
        if self.options.store.memory_budget is not None:
            return
        free = available_memory()
        if free is not None and need > free:
            raise InsufficientMemory(
                f"this rank would hold {need / 2**30:.2f} GiB of the dataset in memory, but "
                f"only {free / 2**30:.2f} GiB is available: pass memory_budget= (e.g. "
                f"memory_budget='{max(1, int(free * 0.8 / 2**30))}G') and spill_dir= on "
                "node-local disk to keep the rest there, or run more ranks (the exchange "
                "splits the dataset between them)"
            )

    def _read_sample(self, index: int, name: str, out: np.ndarray) -> None:
        self.reader.read(index, name, out=out)

    def _open_service(self, dataset: Any, service: ServiceOptions) -> Any:
        """A session of ``datastore serve`` (a ``ServiceSource``)."""
        from datastore.sources.service import ServiceSource

        copies_on = self._stage.stream if self._stage is not None else None
        source = ServiceSource(
            dataset, service, options=self.options, world=self.world, gather=self.gather,
            copies_on=copies_on,
        )  # fmt: skip
        self.grid, self.layout, self.schedule = source.grid, source.layout, source.schedule
        self.fields = source.fields
        self.batch_size = source.batch_size
        self.reader = None
        if source.identity:
            self._data_id = {"location": _name(dataset, str(dataset)), "identity": source.identity}
        return source

    # -- iteration -----------------------------------------------------------------------------
    def _produce(self, epoch: int, start: int, q: queue.Queue, stop: threading.Event) -> None:
        o, lay = self.options, self.layout
        try:
            if self._stage is not None and self._stage.stream is not None:
                torch.cuda.set_device(self._stage.device)
            batches = self._source.batches(epoch, start, stop, self.ring)
            for step, buf in batches:
                host = buf.tensors if self._stage is not None else buf.views()
                if not o.drop_last:
                    valid = self.schedule.valid(step, lay.data_rank, lay.data_world)
                    host = {**host, VALID: torch.from_numpy(valid)}
                if self._stage is not None:  # copies on the side stream
                    batch, event = self._stage.upload(host)
                    buf.release_after(event)
                else:
                    batch, event = host, None
                del host
                if not _offer(q, (step, batch, event), stop):
                    del batch
                    for _ in batches:  # an exchange tells the other ranks at its next step
                        pass
                    return
        except BaseException as exc:  # handed to the consumer, which raises it
            _offer(q, (None, exc, None), stop)
            return
        _offer(q, (None, None, None), stop)

    def __iter__(self):
        """A pass from an epoch's first batch (``EpochPosition``), or the resumption of a
        loaded ``state_dict``; where it starts is decided at its first batch (a
        ``set_epoch`` between ``iter()`` and ``next()`` counts, as with a sampler)."""
        if self._closed or self._broken:
            raise RuntimeError(CLOSED if self._closed else self._broken)
        if self._unchecked is not None:
            self._check_late()
        epoch, start, pass_ = self._new_pass()
        if start < len(self):  # (else a loaded epoch's end: nothing is left of it)
            yield from self._pass_batches(epoch, start, pass_)

    def _pass_batches(self, epoch: int, start: int, pass_: int):
        if self._source.steps_together and any(w.is_alive() for w, _ in self._workers):
            raise RuntimeError(
                "another iterator of this loader is still running: with an exchange (the ranks "
                "step together) or a service (one stream per session) a loader runs one pass "
                "at a time, so finish or delete it (del it) before iter() again"
            )
        q: queue.Queue = queue.Queue(maxsize=self.options.prefetch)
        stop = threading.Event()
        worker = threading.Thread(
            target=self._produce,
            args=(epoch, start, q, stop),
            daemon=True,
            name="datastore-prefetch",
        )
        worker.start()
        self._workers = [(w, s) for w, s in self._workers if w.is_alive()] + [(worker, stop)]
        _PREFETCHING.add((worker, stop))
        stuck = False  # the producer gave nothing within the timeout
        try:
            while True:
                if self._closed:  # (while this pass was open)
                    raise RuntimeError(CLOSED)
                t0 = time.perf_counter()
                try:
                    # (more than the producer's own waits: its error names the peer)
                    step, batch, event = q.get(timeout=self.options.timeout + NAMING_WAIT_S)
                except queue.Empty:
                    stuck = True
                    raise ExchangeTimeout(
                        f"no batch within {self.options.timeout + NAMING_WAIT_S:g} s (the "
                        f"timeout, {self.options.timeout:g} s, and {NAMING_WAIT_S:g} s for the "
                        f"cause; rank {self.world.rank}, epoch {epoch} step {start}): a peer "
                        "rank or the service may have failed",
                        start,
                    ) from None
                self._waited += time.perf_counter() - t0
                if step is None:
                    if batch is not None:
                        raise batch
                    return
                if self._stage is not None:
                    batch = self._stage.hand_out(batch, event)
                if self.transform is not None:  # here: its random draws are the loop's, in order
                    batch = self.transform(batch)
                if self.collate is not None:  # (a batch it fails on is not handed out)
                    batch = self.collate(batch)
                self._handed_out(epoch, step, pass_)
                start = step + 1
                yield batch
                del batch
        finally:
            stop.set()
            # a stuck producer is not waited for again: the error goes out at the timeout
            worker.join(STUCK_WAIT_S if stuck else self.options.timeout + 10)
            _PREFETCHING.discard((worker, stop))
            if worker.is_alive():
                self._broken = (
                    "the loader's prefetch thread did not stop within the timeout (a peer "
                    "rank stopped answering): build a new loader"
                )

    batch_sampler = None  # a DataLoader's attribute that trainers read beside ``sampler``

    @property
    def sampler(self) -> LoaderSampler:
        """What Lightning (and other trainers) call ``set_epoch(epoch)`` on at every epoch, as
        on a ``DistributedSampler``, so their epoch is ours; its ``len`` is the samples this
        rank gets per epoch, as a ``DistributedSampler``'s."""
        return LoaderSampler(self)

    @property
    def dataset(self) -> LoaderDataset:
        """What a ``DataLoader``'s ``dataset`` is to ported scripts: its ``len`` is the samples
        in the dataset, what they divide summed losses by (``len(test_loader.dataset)``)."""
        return LoaderDataset(self.schedule.num_samples)

    # -- what it did ---------------------------------------------------------------------------
    @property
    def session_id(self) -> str | None:
        """The session of ``datastore serve`` this loader streams from (``None``: embedded)."""
        return self._source.session_id

    @property
    def counters(self) -> Counters:
        """What the loader did so far (a snapshot)."""
        return replace(self._source.counters, wait_seconds=self._waited)

    @property
    def store(self) -> Store | None:
        """The embedded source's store of this rank's samples (``None``: ``service=``)."""
        return getattr(self._source, "store", None)

    def close(self) -> None:
        """Free the store, the exchange, the session with the service; tensors handed out
        stay valid. Once closed, iterating raises ``RuntimeError``, also a pass still open
        (its prefetch thread is told to stop first, and ends at what it was doing: a read of
        the freed store, a stream the close cut, ...). Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        for _, stop in self._workers:
            stop.set()
        self._source.close()
        if self.reader is not None:
            self.reader.close()
        if self._coll is not None:
            self._coll.close()
            if self._coll.group is not None and not keeps_group(self.options.exchange.group):
                import torch.distributed as dist  # gloo_group()'s: this loader's own

                if dist.is_initialized():
                    dist.destroy_process_group(self._coll.group)
            self._coll = None
        self.gather.close()

    def __del__(self) -> None:
        # A loader dropped without close() (a notebook, a sweep in one process) would hold its
        # service session, rings and threads until the process ends.
        with contextlib.suppress(Exception):  # (half-made, or the interpreter ending)
            if hasattr(self, "_source") and not sys.is_finalizing():
                self.close()

    def __enter__(self) -> DataStoreLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoaderSampler:
    """``loader.sampler``: the loader's epoch behind a ``DistributedSampler``'s face.
    ``set_epoch(e)`` is the loader's; ``len()`` is the samples this rank gets per epoch
    (``len(loader) * loader.batch_size``, padding repeats included, as a ``DistributedSampler``
    counts its own), not the batches: ported scripts divide summed losses by it."""

    def __init__(self, loader: DataStoreLoader):
        self.loader = loader

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader) * self.loader.batch_size


class LoaderDataset:
    """``loader.dataset``: its ``len()`` is the samples in the dataset (over every rank,
    padding repeats not counted), as a ``DataLoader``'s dataset's."""

    def __init__(self, num_samples: int):
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples


def _data_world(options: LoaderOptions, world: int) -> int:
    """The data ranks of ``world`` (``1`` where the spatial blocks do not divide it: the
    view refuses that on every rank)."""
    blocks = math.prod(options.spatial["parts"]) if options.spatial else 1
    return world // blocks if world % blocks == 0 else 1


def _name(dataset: Any, otherwise: str) -> str:
    """The dataset as the caller named it: its path, else ``otherwise``."""
    return os.fspath(dataset) if isinstance(dataset, str | os.PathLike) else otherwise


def _root(dataset: Any) -> str:
    """The directory that sample file names are taken relative to."""
    path = os.fspath(dataset) if isinstance(dataset, str | os.PathLike) else dataset.paths[0]
    return path if os.path.isdir(path) else os.path.dirname(path)

"""What a layout costs before anything is staged: the model behind ``datastore plan``.

Pure functions over three frozen, validated configs: the dataset (:class:`DatasetSize`), the
machine (:class:`Machine`) and the job (:class:`Job`). No I/O, and nothing grows with the
sample count: 10^8 samples on 4,096 ranks cost what 10 samples on 2 ranks do. (Not to be
confused with ``staging/plan.py``, which lists the files a stage copies.)

The model, per node (``N`` nodes, ``R`` ranks per node, a dataset of ``D`` bytes in ``F``
files; shard places them as the stage does where their sizes are known, else gives the busiest
node ``ceil(F/N)`` of ``F`` equal files: :func:`shard_loads`):

Staging (``datastore stage``)
    Every node reads its share from the parallel filesystem while it writes it to NVMe; the two
    overlap, so the slower one is the time. All nodes read at once and share the filesystem's
    bandwidth, and no node reads faster than its own link::

        read_s  = share / min(pfs_read_bw / readers, network_bw)   readers: nodes that read
        write_s = share / nvme_write_bw
        seconds = max(read_s, write_s)

    ``--mode replicate``: share = ``D`` on every node (the filesystem serves ``N D``);
    ``--mode shard``: share = the busiest node's files. Per-file costs are left out.

Memory per node
    A node holds what it staged, uncompressed: the whole dataset when replicated (served by
    ``datastore serve`` from local memory), its share when sharded (served, or held by the
    embedded loader's ranks, each a contiguous part of the node's samples). On top, per rank:
    the service's shared-memory ring, ``2 * prefetch + 2`` batches (what a session reserves),
    or the embedded loader's ``prefetch + 2`` batch buffers.

Exchange under a shuffle (per step, per rank; what crosses the network)
    Under ``shuffle="global"`` a rank's samples are spread evenly over the dataset, so the
    share owned by other nodes is, for a rank of the node holding least, all but that node's
    share when sharded (``(N-1)/N`` of equal shares) and 0 when every node holds everything (a
    replicated dataset is served from local memory). A rank receives only its
    block with halo (:mod:`datastore.maths.partition`, via
    :func:`datastore.maths.delivery.delivered_fields`). ``"none"`` moves as many bytes to a
    rank; its busiest link is counted over the storage order's global batches, each sample on
    the node its file went to (:func:`storage_order_link`): spread alike over the nodes where
    a file holds fewer samples than a global batch (``stage --mode shard`` deals consecutive
    files to different nodes), on one node, which sends it all, where a file holds a whole
    batch. ``"shard"`` and ``"window:K"`` keep each data
    rank on its home (the samples its own ranks hold): nothing crosses the network unless a spatial
    group spans nodes. The time is the busiest node link's bytes over ``min(network_bw,
    exchange_bw)``, the store's own rate (cutting blocks, packing, unpacking: measured, it can be
    well below the link); its share of a step is that over ``step_time`` (a share above 1: the
    exchange cannot keep up, whatever the prefetch).

A spatial split of ``S`` blocks leaves ``W = N R / S`` data ranks, each taking
``global_batch / W`` samples a step; a rank's memory is that many blocks with halo
(``prefetch + 2`` batches of them in the loader's buffers; ``prefetch + activation_factor``
batches on its GPU).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from datastore.maths.delivery import delivered_fields, spatial_grid
from datastore.maths.partition import BOUNDARIES
from datastore.readers.base import FieldInfo
from staging.plan import split_by_bytes
from staging.progress import human_bytes

__all__ = [
    "LADDER_BLOCKS",
    "STAGINGS",
    "DatasetSize",
    "Job",
    "Layout",
    "Machine",
    "Plan",
    "PlanError",
    "Split",
    "Staging",
    "duration",
    "exchange_cost",
    "layouts",
    "make_plan",
    "offnode_home_share",
    "recommend",
    "shard_loads",
    "split_cost",
    "split_ladder",
    "stage_time",
    "storage_order_link",
]

STAGINGS = ("replicate", "shard")
LADDER_BLOCKS = 64  # default splits are weighed up to this many blocks (further if none works)


class PlanError(ValueError):
    """A value the model cannot work with; the message names it."""


def _whole(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool):
        raise PlanError(f"{name} must be a whole number >= {least}, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise PlanError(f"{name} must be a whole number >= {least}, got {value!r}") from None
    if v < least:
        raise PlanError(f"{name} must be a whole number >= {least}, got {value!r}")
    return v


def _positive(name: str, value: float, allow_zero: bool = False) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise PlanError(
            f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}"
        )
    return v


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class DatasetSize:
    """What the model needs of a dataset.

    Args:
        num_samples: samples.
        fields: every field of a sample (dtype, per-sample shape, spatial axes).
        files: the files the dataset is stored in (the unit ``--mode shard`` places).
            Default: ``0``, one file per sample.
        stored_bytes: bytes on disk (what staging copies). Default: ``0``, the samples' bytes.
        file_sizes: ``(bytes on disk, samples)`` of every file, where known (a dataset read
            from its path), for where ``--mode shard`` places them. Default: ``()``, ``files``
            files of equal size.
    """

    num_samples: int
    fields: tuple[FieldInfo, ...]
    files: int = 0
    stored_bytes: int = 0
    file_sizes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _set(self, "num_samples", _whole("samples", self.num_samples, 1))
        _set(self, "fields", tuple(self.fields))
        if not self.fields:
            raise PlanError("the dataset has no fields")
        if self.sample_bytes < 1:
            raise PlanError("a sample of the dataset holds no bytes")
        files = _whole("files", self.files, 0) or self.num_samples
        _set(self, "files", files)
        sizes = tuple((_whole("file bytes", b, 0), _whole("file samples", n, 0)) for b, n in
                      self.file_sizes)  # fmt: skip
        _set(self, "file_sizes", sizes)
        if sizes and (len(sizes), sum(n for _, n in sizes)) != (files, self.num_samples):
            raise PlanError(
                f"file sizes of {len(sizes)} files holding {sum(n for _, n in sizes)} samples, "
                f"for a dataset of {files} files and {self.num_samples} samples"
            )
        stored = _whole("stored bytes", self.stored_bytes, 0) or self.nbytes
        _set(self, "stored_bytes", stored)

    @property
    def sample_bytes(self) -> int:
        return sum(f.nbytes for f in self.fields)

    @property
    def nbytes(self) -> int:
        """Bytes of every sample, uncompressed (what a store holds)."""
        return self.num_samples * self.sample_bytes

    @property
    def info(self) -> dict[str, FieldInfo]:
        return {f.name: f for f in self.fields}

    @property
    def volume_axes(self) -> int:
        """Spatial axes of the samples' volume (0: no spatial field)."""
        return next((len(f.spatial_axes) for f in self.fields if f.spatial_axes), 0)


@dataclass(frozen=True)
class Machine:
    """The nodes a job runs on. Sizes in bytes, bandwidths in bytes per second.

    Args:
        nodes: nodes of the job.
        ranks_per_node: ranks (processes) per node.
        gpus_per_node: GPUs per node; ``0``: none (no GPU memory check).
        memory_per_node: memory a node may give the data (``datastore serve --memory-budget``).
        gpu_memory: memory of one GPU.
        nvme_per_node: node-local disk free for staging.
        pfs_read_bw: the parallel filesystem's read bandwidth, shared by every node of the job.
        nvme_write_bw: one node's NVMe write bandwidth.
        network_bw: one node's network link (each way).
        exchange_bw: how fast a node's store exchanges samples end to end (cutting, packing,
            the link, unpacking), as measured; ``None``: the link's rate.
    """

    nodes: int
    ranks_per_node: int
    gpus_per_node: int
    memory_per_node: int
    gpu_memory: int
    nvme_per_node: int
    pfs_read_bw: float
    nvme_write_bw: float
    network_bw: float
    exchange_bw: float | None = None

    def __post_init__(self) -> None:
        _set(self, "nodes", _whole("nodes", self.nodes, 1))
        _set(self, "ranks_per_node", _whole("ranks_per_node", self.ranks_per_node, 1))
        _set(self, "gpus_per_node", _whole("gpus_per_node", self.gpus_per_node, 0))
        _set(self, "memory_per_node", _whole("memory_per_node", self.memory_per_node, 1))
        for name in ("gpu_memory", "nvme_per_node"):
            _set(self, name, _whole(name, getattr(self, name), 0))
        for name in ("pfs_read_bw", "nvme_write_bw", "network_bw"):
            _set(self, name, _positive(name, getattr(self, name)))
        if self.exchange_bw is not None:
            _set(self, "exchange_bw", _positive("exchange_bw", self.exchange_bw))

    @property
    def exchange_rate(self) -> float:
        """Bytes per second a node's exchange moves: its link, or the store's own rate if
        slower."""
        return min(self.network_bw, self.exchange_bw or self.network_bw)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def gpu_memory_per_rank(self) -> int:
        """A rank's part of the GPU memory (ranks beyond the GPUs share them)."""
        if self.gpus_per_node == 0:
            return 0
        share = min(1.0, self.gpus_per_node / self.ranks_per_node)
        return int(self.gpu_memory * share)


@dataclass(frozen=True)
class Job:
    """The training job.

    Args:
        global_batch: samples per step over all ranks.
        step_time: seconds of one training step.
        spatial: the spatial splits to weigh (``parts`` per split, as ``DataStoreLoader``'s
            ``spatial``). Default: ``()``, a ladder of splits (:func:`split_ladder`).
        halo: halo width, one for every axis or one per axis. Default: ``(0,)``.
        boundary: ``"zero"`` or ``"clip"``, as the loader's. Default: ``"zero"``.
        prefetch: batches prepared ahead, as the loader's. Default: ``2``.
        window: ``K`` of ``shuffle="window:K"``. Default: ``4096``.
        activation_factor: GPU bytes the step takes per byte of a rank's input batch (peak
            memory over batch bytes, measured once); ``0``: unknown, only the batches count.
            Default: ``0``.
        max_exchange_share: the share of a step the global shuffle's exchange may take before
            a local shuffle is recommended. Default: ``0.1``.
    """

    global_batch: int
    step_time: float
    spatial: tuple[tuple[int, ...], ...] = ()
    halo: tuple[int, ...] = (0,)
    boundary: str = "zero"
    prefetch: int = 2
    window: int = 4096
    activation_factor: float = 0.0
    max_exchange_share: float = 0.1

    def __post_init__(self) -> None:
        _set(self, "global_batch", _whole("global_batch", self.global_batch, 1))
        _set(self, "step_time", _positive("step_time", self.step_time))
        parts = tuple(tuple(_whole("spatial parts", p, 1) for p in s) for s in self.spatial)
        if any(not p for p in parts):
            raise PlanError("a spatial split needs one part count per spatial axis, got none")
        _set(self, "spatial", parts)
        halo = tuple(_whole("halo", h, 0) for h in self.halo)
        if not halo:
            raise PlanError("halo needs one width, or one per spatial axis")
        _set(self, "halo", halo)
        if self.boundary not in BOUNDARIES:
            raise PlanError(f"boundary must be one of {BOUNDARIES}, got {self.boundary!r}")
        _set(self, "prefetch", _whole("prefetch", self.prefetch, 1))
        _set(self, "window", _whole("window", self.window, 1))
        _set(
            self, "activation_factor", _positive("activation_factor", self.activation_factor, True)
        )
        _set(self, "max_exchange_share", _positive("max_exchange_share", self.max_exchange_share))

    def spatial_of(self, parts: tuple[int, ...]) -> dict[str, Any]:
        """The loader's ``spatial=`` for ``parts``."""
        halo: Any = self.halo[0] if len(self.halo) == 1 else self.halo
        return {"parts": parts, "halo": halo, "boundary": self.boundary}


# ----------------------------------------------------------------------------- staging


def shard_loads(ds: DatasetSize, nodes: int) -> tuple[int, int, int]:
    """Under ``--mode shard``: the bytes on disk of the busiest node, and the most and the least
    bytes of samples a node holds. Where the files' sizes are known, the stage's own placement
    of them (:func:`staging.plan.split_by_bytes`: largest first, to the least loaded node;
    taken as ``ceil(F/N)`` of ``F`` equal files, the 64 and 56 samples two nodes held of HDF5
    shards of 16 samples, 7 of them, and one of 8 were 60 each, the 30 and 6 of shards of 30,
    2, 2 and 2 were 18 each). Else ``F`` files of equal size, dealt evenly."""
    if not ds.file_sizes:
        most, least = -(-ds.files // nodes), ds.files // nodes
        return (
            ds.stored_bytes * most // ds.files,
            ds.nbytes * most // ds.files,
            ds.nbytes * least // ds.files,
        )
    disk, samples = [0] * nodes, [0] * nodes
    for (nbytes, n), node in zip(
        ds.file_sizes, split_by_bytes([b for b, _ in ds.file_sizes], nodes), strict=True
    ):
        disk[node] += nbytes
        samples[node] += n
    return max(disk), max(samples) * ds.sample_bytes, min(samples) * ds.sample_bytes


@dataclass(frozen=True)
class Staging:
    """``datastore stage --mode MODE`` on the busiest node."""

    mode: str
    bytes_per_node: int
    read_s: float
    write_s: float
    bound: str  # what limits it: "PFS", "node link" or "NVMe write"
    fits_nvme: bool
    empty_nodes: int = 0  # nodes given no file (``--mode shard`` of fewer files than nodes)

    @property
    def seconds(self) -> float:
        return max(self.read_s, self.write_s)


def stage_time(ds: DatasetSize, m: Machine, mode: str) -> Staging:
    """Time to stage ``ds`` with ``--mode mode`` (the busiest node's), and whether it fits."""
    share = ds.stored_bytes if mode == "replicate" else shard_loads(ds, m.nodes)[0]
    readers = m.nodes if mode == "replicate" else min(m.nodes, ds.files)
    pfs_each = m.pfs_read_bw / readers
    read_s = share / min(pfs_each, m.network_bw)
    write_s = share / m.nvme_write_bw
    if write_s >= read_s:
        bound = "NVMe write"
    else:
        bound = "PFS" if pfs_each <= m.network_bw else "node link"
    empty = 0 if mode == "replicate" else max(0, m.nodes - ds.files)
    return Staging(mode, share, read_s, write_s, bound, share <= m.nvme_per_node, empty)


# ----------------------------------------------------------------------------- spatial splits


@dataclass(frozen=True)
class Split:
    """What each rank receives under one spatial split (the busiest rank's figures).

    ``parts`` is ``None`` for whole samples. ``rank_sample_bytes``: one sample's delivered
    fields on a rank (its block with halo, non-spatial fields whole); ``overhead``: the bytes
    all blocks of a sample receive together, over the sample's, minus 1 (halos, padding and
    fields every block gets whole); ``buffer_bytes``: the loader's ``prefetch + 2`` batch
    buffers; ``gpu_bytes``: ``prefetch + activation_factor`` batches.
    """

    parts: tuple[int, ...] | None
    blocks: int
    data_world: int
    local_batch: int
    rank_sample_bytes: int
    sample_delivered_bytes: int
    overhead: float
    batch_bytes: int
    buffer_bytes: int
    gpu_bytes: int
    fits_gpu: bool


def split_ladder(ds: DatasetSize, m: Machine) -> list[tuple[int, ...] | None]:
    """The splits weighed when none is given: whole samples, then the spatial axes doubled in
    turn, first axis first (``(2,1,1)``, ``(2,2,1)``, ``(2,2,2)``, ``(4,2,2)``...), while the
    blocks fit the world."""
    axes = ds.volume_axes
    ladder: list[tuple[int, ...] | None] = [None]
    if not axes:
        return ladder
    parts = [1] * axes
    i = 0
    while True:
        parts[i % axes] *= 2
        i += 1
        if math.prod(parts) > m.world:
            return ladder
        ladder.append(tuple(parts))


def split_cost(ds: DatasetSize, m: Machine, job: Job, parts: tuple[int, ...] | None) -> Split:
    """A rank's data under the split ``parts`` (``None``: whole samples).

    Raises:
        PlanError: the loader would refuse it (a part larger than its axis, a halo wider than
            a block, no spatial field), its blocks do not divide the ranks, or its data ranks
            do not divide the global batch.
    """
    name = "whole samples" if parts is None else f"spatial parts {parts}"
    grid = None
    if parts is not None:
        try:
            grid = spatial_grid(ds.info, job.spatial_of(parts))
        except ValueError as exc:
            raise PlanError(f"{name}: {exc}") from None
    blocks = 1 if grid is None else grid.nblocks
    if m.world % blocks:
        raise PlanError(
            f"{name}: {blocks} blocks do not divide the {m.world} ranks "
            f"({m.nodes} nodes x {m.ranks_per_node})"
        )
    data_world = m.world // blocks
    if job.global_batch % data_world:
        ranks = f"{m.world} ranks" if blocks == 1 else f"{data_world} data-parallel ranks"
        ranks += "" if blocks == 1 else f" ({m.world} ranks / {blocks} blocks)"
        raise PlanError(
            f"{name}: the global batch {job.global_batch} is not divisible by the {ranks}"
        )
    local_batch = job.global_batch // data_world
    per_block = [sum(f.nbytes for f in delivered_fields(ds.info, grid, k)) for k in range(blocks)]
    rank_sample = max(per_block)
    batch = local_batch * rank_sample
    gpu = int(batch * (job.prefetch + job.activation_factor)) if m.gpus_per_node else 0
    return Split(
        parts=parts,
        blocks=blocks,
        data_world=data_world,
        local_batch=local_batch,
        rank_sample_bytes=rank_sample,
        sample_delivered_bytes=sum(per_block),
        overhead=sum(per_block) / ds.sample_bytes - 1,
        batch_bytes=batch,
        buffer_bytes=(job.prefetch + 2) * batch,
        gpu_bytes=gpu,
        fits_gpu=m.gpus_per_node == 0 or gpu <= m.gpu_memory_per_rank,
    )


# ----------------------------------------------------------------------------- exchange


def offnode_home_share(blocks: int, m: Machine) -> float:
    """The share of a data rank's home held on other nodes, averaged over ranks: a data rank's
    ``blocks`` ranks are consecutive (spatial-fastest), so its group may span nodes."""
    rpn = m.ranks_per_node
    if blocks <= rpn and rpn % blocks == 0:
        return 0.0
    first = np.arange(m.world // blocks, dtype=np.int64) * blocks
    last = first + blocks - 1
    n0, n1 = first // rpn, last // rpn
    head = np.where(n0 == n1, blocks, (n0 + 1) * rpn - first)
    tail = np.where(n0 == n1, 0, last + 1 - n1 * rpn)
    middle = np.maximum(n1 - n0 - 1, 0) * rpn * rpn
    same = (head * head + tail * tail + middle) / (blocks * blocks)
    return float(1.0 - same.mean())


@dataclass(frozen=True)
class Layout:
    """One way to hold and shuffle the dataset, and what it costs per node and step.

    ``source``: ``"serve"`` (``datastore serve``) or ``"embedded"`` (``DataStoreLoader``
    without ``address=``; ``"shard"`` and ``"window:K"`` exist only there).
    ``exchange_bytes``: what one rank receives from other nodes per step (expected);
    ``exchange_s``: the busiest node link's time per step; ``exchange_share``: over the step.
    """

    staging: str
    shuffle: str
    source: str
    resident_bytes: int
    buffer_bytes: int
    fits_memory: bool
    fits_nvme: bool
    exchange_bytes: int
    exchange_s: float
    exchange_share: float
    draws_from: str

    @property
    def memory_bytes(self) -> int:
        return self.resident_bytes + self.buffer_bytes


def _holders(ds: DatasetSize, nodes: int, positions: np.ndarray) -> np.ndarray:
    """The node holding each sample of the storage order at ``positions`` under ``--mode
    shard``: the node the stage put its file on (:func:`shard_loads`'s placement; equal files
    are dealt in turn)."""
    if not ds.file_sizes:
        return positions * ds.files // ds.num_samples % nodes
    ends = np.cumsum([n for _, n in ds.file_sizes])
    placed = np.array(split_by_bytes([b for b, _ in ds.file_sizes], nodes))
    return placed[np.searchsorted(ends, positions, side="right")]


def storage_order_link(
    ds: DatasetSize, m: Machine, job: Job, split: Split, most: int = 64
) -> float:
    """Under ``shuffle="none"`` with ``--mode shard``: the bytes the busiest node link carries
    a step (in or out), averaged over up to ``most`` global batches spread over the epoch
    (fewer where they would hold over 2^22 samples). Default: ``64``. A global batch is a run
    of the storage order; each sample goes from the node holding its file (:func:`_holders`)
    to the ranks of the data rank whose slice of the batch holds it (spatial-fastest), those
    on other nodes over the links. Files of at least a global batch put each batch on one
    node, which sends all of it but its own ranks' part; files of fewer samples spread it
    over the nodes (taken as on one node, 30 files of 2 samples, a global batch of 8 on 2
    nodes, gave 2x what a real run moved)."""
    n, rpn, g = m.nodes, m.ranks_per_node, job.global_batch
    steps = ds.num_samples // g
    if not steps:
        return 0.0
    k = min(steps, most, max(1, (1 << 22) // g))
    firsts = np.unique(np.linspace(0, steps - 1, k).round().astype(np.int64)) * g
    k = len(firsts)
    held = _holders(ds, n, (firsts[:, None] + np.arange(g, dtype=np.int64)).reshape(-1))
    step = np.repeat(np.arange(k, dtype=np.int64), g)
    first = np.tile(np.arange(g, dtype=np.int64) // split.local_batch, k) * split.blocks
    link_in, link_out = np.zeros(k * n), np.zeros(k * n)
    for j in range(-(-split.blocks // rpn) + 1):  # the nodes a data rank's ranks span
        node = first // rpn + j
        ranks = np.minimum(first + split.blocks, (node + 1) * rpn) - np.maximum(first, node * rpn)
        away = np.where(held != node, np.maximum(ranks, 0), 0)  # its ranks there, fed from afar
        link_in += np.bincount(step * n + np.minimum(node, n - 1), away, k * n)
        link_out += np.bincount(step * n + held, away, k * n)
    busiest = np.maximum(link_in.reshape(k, n).max(axis=1), link_out.reshape(k, n).max(axis=1))
    return float(busiest.mean()) * split.rank_sample_bytes


def exchange_cost(
    m: Machine,
    job: Job,
    split: Split,
    staging: str,
    shuffle: str,
    held: tuple[float, float] | None = None,
    storage_link: float | None = None,
) -> tuple[int, float]:
    """``(bytes the busiest rank receives from other nodes per step, seconds of the busiest
    link)`` under ``shuffle`` with the dataset staged ``staging``. ``held``: the least and the
    most share of the samples a node holds when sharded (files of different sizes: a rank of
    the node holding least draws the most from other nodes, the node holding most sends the
    most). Default: ``1/N`` each. ``storage_link``: the busiest link's bytes a step under
    ``"none"`` when sharded (:func:`storage_order_link`). Default: ``None``, every global
    batch on one node (files of at least a global batch)."""
    n, rpn = m.nodes, m.ranks_per_node
    least, most = held or (1 / n, 1 / n)
    if shuffle in ("global", "none"):
        remote = 0.0 if staging == "replicate" else 1 - least
    else:
        remote = offnode_home_share(split.blocks, m)
    per_rank = split.local_batch * split.rank_sample_bytes * remote
    node_in = rpn * per_rank
    if shuffle == "none" and remote and storage_link is not None:
        node_in = node_out = storage_link
    elif shuffle == "none" and remote:  # every global batch on one node, which sends it
        node_in = rpn * split.local_batch * split.rank_sample_bytes
        node_out = job.global_batch * split.sample_delivered_bytes * (n - 1) / n
    elif shuffle in ("global", "none") and remote:  # the other nodes' ranks draw from it
        node_out = (n - 1) * rpn * split.local_batch * split.rank_sample_bytes * most
    else:
        node_out = node_in
    return round(per_rank), max(node_in, node_out) / m.exchange_rate


def _buffers(m: Machine, job: Job, split: Split, source: str) -> int:
    """Batch buffers per node: the service's shared-memory rings, or the loaders' own."""
    per_rank = (
        (2 * job.prefetch + 2) * split.batch_bytes if source == "serve" else split.buffer_bytes
    )
    return m.ranks_per_node * per_rank


def layouts(ds: DatasetSize, m: Machine, job: Job, split: Split) -> list[Layout]:
    """Every staging with the shuffles that suit it: a replicated dataset served whole
    (``"global"``, ``"none"``); a sharded one served or exchanged (``"global"``, ``"none"``;
    the embedded loader where the service cannot shard it: several samples a file) or kept
    home by the embedded loader (``"shard"``, ``"window:K"``)."""
    staged = {s: stage_time(ds, m, s) for s in STAGINGS}
    w = split.data_world
    draws = {
        "global": "the whole dataset",
        "none": "the whole dataset, in storage order",
        "shard": f"its home: 1/{w} of the dataset",
        f"window:{job.window}": f"its home (1/{w}), in windows of {job.window}",
    }
    per_file = ds.files == ds.num_samples  # the service shards one-sample-per-file sets only
    _, most, least = shard_loads(ds, m.nodes)
    held = (least / ds.nbytes, most / ds.nbytes)
    storage_link = storage_order_link(ds, m, job, split)
    rows = [
        ("replicate", "global", "serve"),
        ("replicate", "none", "serve"),
        ("shard", "global", "serve" if per_file else "embedded"),
        ("shard", "none", "serve" if per_file else "embedded"),
        ("shard", "shard", "embedded"),
        ("shard", f"window:{job.window}", "embedded"),
    ]
    out = []
    for staging, shuffle, source in rows:
        resident = ds.nbytes if staging == "replicate" else most
        buffers = _buffers(m, job, split, source)
        link = storage_link if (staging, shuffle) == ("shard", "none") else None
        nbytes, seconds = exchange_cost(m, job, split, staging, shuffle, held, link)
        out.append(
            Layout(
                staging=staging,
                shuffle=shuffle,
                source=source,
                resident_bytes=resident,
                buffer_bytes=buffers,
                fits_memory=resident + buffers <= m.memory_per_node,
                fits_nvme=staged[staging].fits_nvme,
                exchange_bytes=nbytes,
                exchange_s=seconds,
                exchange_share=seconds / job.step_time,
                draws_from=draws[shuffle],
            )
        )
    return out


# ----------------------------------------------------------------------------- the plan


def duration(seconds: float) -> str:
    """``0.98 s``, ``15.6 s``, ``8.7 min``, ``8.7 h``, ``362 d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


@dataclass(frozen=True)
class Plan:
    """Everything ``datastore plan`` reports."""

    dataset: DatasetSize
    machine: Machine
    job: Job
    staging: tuple[Staging, ...]
    splits: tuple[Split, ...]
    split: Split  # the one chosen; ``layouts`` are under it
    layouts: tuple[Layout, ...]
    recommended: Layout | None
    reasons: tuple[str, ...]


def _choose_split(splits: list[Split], m: Machine, job: Job) -> tuple[Split, str]:
    """The fewest blocks (the least halo) whose batches fit the GPU, and why. A rank's batch
    holds ``global_batch / world`` samples' worth of voxels whatever the split: a split is
    needed where the global batch is smaller than the world, and does not make room on a GPU
    (a smaller global batch, or more ranks, does)."""
    fit = [s for s in splits if s.fits_gpu]
    chosen = fit[0] if fit else splits[0]
    name = "whole samples" if chosen.parts is None else f"spatial parts {chosen.parts}"
    why = (
        f"{name}: {chosen.blocks} block(s), {chosen.data_world} data ranks of "
        f"{chosen.local_batch} sample(s) a step"
    )
    if len(splits) > 1:
        why += " (the fewest blocks that work)"
    if m.gpus_per_node:
        gpu, room = human_bytes(chosen.gpu_bytes), human_bytes(m.gpu_memory_per_rank)
        why += f"; {gpu} a rank on its GPU of {room}"
        if not fit:
            why += (
                ": DOES NOT FIT, and no split makes room (a rank's batch is global_batch / "
                "ranks samples' worth of voxels whatever the split): lower the global batch "
                "or add ranks"
            )
        if job.activation_factor == 0:
            why += "; batches only (activation_factor adds the model's memory)"
    return chosen, why


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def recommend(
    staged: dict[str, Staging], rows: list[Layout], job: Job
) -> tuple[Layout | None, list[str]]:
    """The layout to use and the reasons, in order of preference: replicated and served (no
    exchange, full shuffle) if it fits; sharded with the global shuffle if its exchange stays
    within ``max_exchange_share`` of a step; sharded with ``shuffle="shard"`` otherwise; sharded
    with ``"window:K"`` when even a node's shard is larger than memory; nothing when a shard
    does not fit on NVMe, or the dataset has fewer files than nodes (some would hold none)."""
    by = {(r.staging, r.shuffle): r for r in rows}
    rep, shard_g, home = by["replicate", "global"], by["shard", "global"], by["shard", "shard"]
    rep_s, shard_s = staged["replicate"], staged["shard"]
    times = (
        f"staging takes {duration(rep_s.seconds)} replicated ({rep_s.bound} bound), "
        f"{duration(shard_s.seconds)} sharded ({shard_s.bound} bound)"
    )
    if rep.fits_nvme and rep.fits_memory:
        return rep, [
            f"replicate: every node holds the whole dataset, {human_bytes(rep.memory_bytes)} "
            "with the service's rings; nothing crosses the network and every rank draws from "
            "the whole dataset",
            times,
        ]
    where = "in memory" if rep.fits_nvme else "on NVMe"
    big = rep.memory_bytes if rep.fits_nvme else rep_s.bytes_per_node
    why_not = f"replicate does not fit {where} ({human_bytes(big)} a node)"
    if shard_s.empty_nodes:
        held_once = (
            "; or stage it replicated and hold it once over the ranks with the embedded "
            "loader's exchange (each rank a contiguous 1/ranks of the samples)"
        )
        return None, [
            why_not,
            f"nor can it be sharded: it has fewer files than nodes, so {shard_s.empty_nodes} "
            "node(s) would hold none of it (the loader refuses a node without the dataset): "
            "store it in at least as many files as nodes, or use fewer nodes"
            + (held_once if rep.fits_nvme else ""),
        ]
    if not shard_s.fits_nvme:
        return None, [
            why_not,
            f"nor does a shard ({human_bytes(shard_s.bytes_per_node)} on the busiest node): "
            "add nodes, or read from the parallel filesystem",
        ]
    if not (shard_g.fits_memory or home.fits_memory):
        window = by["shard", f"window:{job.window}"]
        return window, [
            why_not,
            f"nor does a node's shard fit in memory ({human_bytes(window.memory_bytes)}): the "
            "embedded loader keeps what fits (memory_budget) and reads the rest from NVMe; "
            f"shuffle='window:{job.window}' keeps those reads sequential",
            times,
        ]
    embedded = ""
    if not shard_g.fits_memory and home.fits_memory:  # the service's rings are what overflow
        embedded = (
            "; by the embedded loader's exchange (with the service's rings a node would need "
            f"{human_bytes(shard_g.memory_bytes)})"
        )
        buffers = home.buffer_bytes
        shard_g = replace(shard_g, source="embedded", buffer_bytes=buffers, fits_memory=True)
    limit = f"(limit {_pct(job.max_exchange_share)})"
    share = _pct(shard_g.exchange_share)
    if shard_g.fits_memory and shard_g.exchange_share <= job.max_exchange_share:
        return shard_g, [
            why_not,
            f"shard: a node holds {human_bytes(shard_g.resident_bytes)}; the global shuffle "
            f"moves {human_bytes(shard_g.exchange_bytes)} a rank a step between nodes, {share} "
            f"of a step {limit}{embedded}",
            times,
        ]
    if shard_g.fits_memory and home.exchange_share >= shard_g.exchange_share:
        return shard_g, [
            why_not,
            f"shard: a node holds {human_bytes(shard_g.resident_bytes)}; the global shuffle "
            f"moves {human_bytes(shard_g.exchange_bytes)} a rank a step between nodes, {share} "
            f"of a step {limit}, but shuffle='shard' would move as much (a data rank's spatial "
            f"blocks span nodes): more ranks per node, or fewer blocks, move less{embedded}",
            times,
        ]
    if shard_g.fits_memory:
        cost = f"the global shuffle's exchange would take {share} of a step {limit}"
    else:
        cost = f"a served shard does not fit in memory ({human_bytes(shard_g.memory_bytes)})"
    return home, [
        why_not,
        cost,
        "shuffle='shard' (embedded loader: its homes are the nodes' shards) moves "
        f"{human_bytes(home.exchange_bytes)} a rank a step between nodes "
        f"({_pct(home.exchange_share)} of a step), but each data rank draws only from "
        f"{home.draws_from}: check the mixing (benchmarks/shuffle.py)",
        times,
    ]


def make_plan(ds: DatasetSize, m: Machine, job: Job) -> Plan:
    """The whole plan: staging, splits, layouts under the chosen split, and a recommendation.
    With no split given, the ladder (:func:`split_ladder`) is weighed up to
    :data:`LADDER_BLOCKS` blocks, and on until a split works.

    Raises:
        PlanError: a global batch larger than the dataset, a split given in ``job.spatial``
            that cannot work, or (with none given) no split of the ladder that works, naming
            why the whole samples do not.
    """
    if job.global_batch > ds.num_samples:
        raise PlanError(
            f"the global batch {job.global_batch} is more than the dataset's {ds.num_samples} "
            "samples: an epoch would have no whole batch (the loader refuses it with "
            "drop_last=True, as the trainer trains); use a smaller global batch"
        )
    staged = {s: stage_time(ds, m, s) for s in STAGINGS}
    axes = ds.volume_axes
    if len(job.halo) > 1 and len(job.halo) != axes:
        raise PlanError(
            f"halo {job.halo} needs one width, or one per spatial axis of the samples ({axes})"
        )
    if job.spatial:
        splits = sorted((split_cost(ds, m, job, p) for p in job.spatial), key=lambda s: s.blocks)
    else:
        splits, first_error = [], None
        for parts in split_ladder(ds, m):
            if splits and parts is not None and math.prod(parts) > LADDER_BLOCKS:
                break
            try:
                splits.append(split_cost(ds, m, job, parts))
            except PlanError as exc:
                first_error = first_error or exc
        if not splits:
            assert first_error is not None  # the ladder holds whole samples at least
            tried = "" if axes == 0 else "; nor does any spatial split up to the world's size"
            raise PlanError(f"{first_error}{tried}")
    split, why_split = _choose_split(splits, m, job)
    rows = layouts(ds, m, job, split)
    chosen, reasons = recommend(staged, rows, job)
    return Plan(
        dataset=ds,
        machine=m,
        job=job,
        staging=tuple(staged.values()),
        splits=tuple(splits),
        split=split,
        layouts=tuple(rows),
        recommended=chosen,
        reasons=(*reasons, why_split),
    )

"""Samples that live on some nodes only: the global index and owners of a sharded dataset.

After ``datastore stage --mode shard`` each node holds a share of a dataset's files under the
same path: files of one sample each (``.npy``/``.npz`` files, one HDF5 file per sample), or
HDF5 shards of several samples each (``part-000.h5``...), moved whole. Every rank lists its
local files (names relative to the dataset path) with their sample counts and all ranks exchange
the lists. If they differ, the dataset is sharded: the sorted union of the names, each file's
samples in a row, is the global index (the same order as one directory holding every file), a
sample is owned by the ranks that have its file locally (a node's samples split in contiguous
ranges among them), and an owner reads only its own files through ``LocalView``. If every rank
sees the same files, nothing changes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from datastore.order import contiguous_owners

__all__ = [
    "SHARDABLE",
    "SHARD_SETS",
    "LocalView",
    "local_files",
    "owners_by_holders",
    "plan_shards",
    "shard_layout",
]

SHARDABLE = ("npy", "hdf5-per-sample")  # one sample per file (also the service's node shards)
SHARD_SETS = ("hdf5",)  # several samples per file: the loader shards these by whole files

Listing = tuple[str | None, dict[str, int], dict[str, Any]]
"""``(format or None when not shardable, {local file: samples}, {field: (dtype, shape)})``."""


def _starts(counts: np.ndarray) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]``: where each file's samples start, and the total."""
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def owners_by_holders(
    names: list[str], holders: list[list[str]], counts: Sequence[int] | None = None
) -> np.ndarray:
    """The owner rank of every sample of the files ``names`` (the sorted union of ``holders``).

    ``holders[r]`` lists the files rank ``r`` has locally; ``counts[k]`` is the number of samples
    of ``names[k]`` (default: one each), which follow each other in the global index. Ranks with
    the same files form a group (a node); each file goes to the first group holding it, and a
    group's samples are split in contiguous, balanced ranges over its ranks.
    """
    counts = np.ones(len(names), np.int64) if counts is None else np.asarray(counts, np.int64)
    starts = _starts(counts)
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, held in enumerate(holders):
        groups.setdefault(tuple(sorted(held)), []).append(rank)
    index = {n: i for i, n in enumerate(names)}
    owner = np.full(int(starts[-1]), -1, dtype=np.int64)
    taken = np.zeros(len(names), dtype=bool)
    for held, ranks in groups.items():
        files = sorted(k for k in (index[n] for n in held) if not taken[k])
        taken[files] = True
        samples = np.concatenate(
            [np.arange(starts[k], starts[k + 1]) for k in files] or [np.zeros(0, np.int64)]
        )
        owner[samples] = np.asarray(ranks, np.int64)[contiguous_owners(len(samples), len(ranks))]
    return owner


class LocalView:
    """A reader over the global index that reads only this rank's local samples.

    Args:
        local: the reader of this rank's files (their samples in the order of ``local_names``).
        names: every file of the dataset, in global order.
        local_names: the files of ``local``, in its order.
        counts: samples in each of ``names``. Default: one each.
    """

    def __init__(
        self,
        local: Any,
        names: list[str],
        local_names: list[str],
        counts: Sequence[int] | None = None,
    ):
        self.local = local
        self.fields = local.fields
        self._names = list(names)
        counts = np.ones(len(names), np.int64) if counts is None else np.asarray(counts, np.int64)
        self._starts = _starts(counts)
        at = {n: k for k, n in enumerate(self._names)}
        mine = np.array([at[n] for n in local_names], dtype=np.int64)
        # where each global file's samples start in the local reader; -1: not on this node
        self._local_start = np.full(len(names), -1, dtype=np.int64)
        self._local_start[mine] = _starts(counts[mine])[:-1]

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, index: int, field: str, region: Any = None, out: Any = None) -> np.ndarray:
        if not 0 <= index < len(self):
            raise ValueError(f"sample {index} out of range [0, {len(self)})")
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        start = int(self._local_start[k])
        if start < 0:
            raise ValueError(f"sample {index} ({self._names[k]}) is not on this node")
        local = start + index - int(self._starts[k])
        return self.local.read(local, field, region=region, out=out)

    def close(self) -> None:
        self.local.close()


def local_files(reader: Any, root: str) -> dict[str, int] | None:
    """``{file name relative to root: samples}`` of ``reader``'s files in its order, or ``None``
    for a dataset that cannot be split by files: a format not split by files, or a dataset
    named by its files (not a directory or glob; ranks naming different files name different
    datasets, which the loader's agreement refuses)."""
    fmt, files = getattr(reader, "format", None), getattr(reader, "files", None)
    paths = getattr(getattr(reader, "spec", None), "paths", ())
    if files is None or all(os.path.isfile(p) for p in paths):
        return None
    if fmt in SHARDABLE:
        counts = [1] * len(files)
    elif fmt in SHARD_SETS and hasattr(reader, "offsets"):
        counts = np.diff(reader.offsets).tolist()
    else:
        return None
    return {os.path.relpath(f, root): n for f, n in zip(files, counts, strict=True)}


def plan_shards(every: list[Listing]) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """``(names, samples per name, owner of every sample)`` from every rank's ``Listing``, or
    ``None`` when some rank's dataset is not shardable or every rank holds the same files.

    Raises:
        ValueError: the ranks read different formats (a node's share of HDF5 shards of equal
            sizes looks like one sample per file), different fields, or one file with
            different sample counts.
    """
    if not all(fmt for fmt, _, _ in every) or all(held == every[0][1] for _, held, _ in every):
        return None
    by_format: dict[str, list[int]] = {}
    for rank, (fmt, _, _) in enumerate(every):
        by_format.setdefault(str(fmt), []).append(rank)
    if len(by_format) > 1:
        listed = "; ".join(f"ranks {', '.join(map(str, r))}: {fmt}" for fmt, r in by_format.items())
        raise ValueError(
            f"the nodes' shares of the dataset are read as different formats ({listed}); "
            "a share of HDF5 shards of equal sizes looks like one sample per file: give every "
            'rank a spec with format = "hdf5"'
        )
    if any(sig != every[0][2] for _, _, sig in every):
        raise ValueError("the nodes' shards of the dataset have different fields or shapes")
    seen: dict[str, tuple[int, int]] = {}
    for rank, (_, held, _) in enumerate(every):
        for name, n in held.items():
            first = seen.setdefault(name, (n, rank))
            if first[0] != n:
                raise ValueError(
                    f"file {name!r} holds {first[0]} samples on rank {first[1]} and {n} on "
                    f"rank {rank}"
                )
    names = sorted(seen)
    counts = np.array([seen[n][0] for n in names], dtype=np.int64)
    owner = owners_by_holders(names, [list(held) for _, held, _ in every], counts)
    return names, counts, owner


def shard_layout(reader: Any, root: str, comm: Any) -> tuple[Any, np.ndarray] | None:
    """``(view, owner)`` when ranks hold different files of a shardable dataset, else ``None``.

    Collective over ``comm``. Refuses (``ValueError``) datasets whose formats, fields or file
    sample counts differ by node (``plan_shards``).
    """
    local = local_files(reader, root)
    signature = {n: (str(f.dtype), tuple(f.shape)) for n, f in reader.fields.items()}
    fmt = getattr(reader, "format", None) if local is not None else None
    plan = plan_shards(comm.allgather((fmt, local or {}, signature)))
    if plan is None:
        return None
    names, counts, owner = plan
    return LocalView(reader, names, list(local or {}), counts), owner

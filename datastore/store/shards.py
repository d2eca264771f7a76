"""Samples that live on some nodes only: the global index and owners of a sharded dataset.

After ``datastore stage --mode shard`` each node holds a share of a dataset's files under the
same path: files of one sample each (``.npy``/``.npz`` files, one HDF5 file per sample), or
shards of several samples each (HDF5 ``part-000.h5``..., tar ``shard-000000.tar``...), moved
whole. Every rank lists its
local files (names relative to the dataset path) with their sample counts. If the lists
differ, the dataset is sharded: the sorted union of the names, each file's samples in a row,
is the global index (the same order as one directory holding every file), a sample is owned by
the ranks that have its file locally (a node's samples split in contiguous ranges among them),
and an owner reads only its own files through ``LocalView``. If every rank sees the same files,
nothing changes.

No rank receives every rank's list: rank 0 gathers them and plans, then broadcasts the owners
as runs (``datastore.maths.ownership.RunOwners``: at most files + ranks of them) and scatters to
each rank where its own files start in the global index.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from datastore.maths.ownership import RunOwners

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
SHARD_SETS = ("hdf5", "tar")  # several samples per file: the loader shards these by whole files

Listing = tuple[str | None, dict[str, int], dict[str, Any]]
"""``(format or None when not shardable, {local file: samples}, {field: (dtype, shape)})``."""


def _starts(counts: np.ndarray) -> np.ndarray:
    """``[0, c0, c0 + c1, ...]``: where each file's samples start, and the total."""
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def owners_by_holders(
    names: list[str], holders: list[list[str]], counts: Sequence[int] | None = None
) -> RunOwners:
    """The owner rank of every sample of the files ``names`` (the sorted union of ``holders``),
    as runs.

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
    taken = np.zeros(len(names), dtype=bool)
    run_starts, run_ranks = [], []
    for held, ranks in groups.items():
        files = np.array(sorted(k for k in (index[n] for n in held) if not taken[k]), np.int64)
        taken[files] = True
        if not files.size:
            continue
        begin = starts[files]  # where each of the group's files starts in the global index
        at = _starts(counts[files])  # ... and in the group's own row of samples
        total, n = int(at[-1]), len(ranks)
        sizes = np.full(n, total // n, dtype=np.int64)
        sizes[: total % n] += 1
        shares = _starts(sizes)[:-1]  # where each rank's range starts in the group's row
        cuts = np.union1d(at[:-1], shares[shares < total])
        f = np.searchsorted(at, cuts, side="right") - 1
        run_starts.append(begin[f] + cuts - at[f])
        run_ranks.append(np.asarray(ranks, np.int64)[np.searchsorted(shares, cuts, "right") - 1])
    if not run_starts:
        return RunOwners([], [], 0)
    first, rank = np.concatenate(run_starts), np.concatenate(run_ranks)
    order = np.argsort(first, kind="stable")
    return RunOwners(first[order], rank[order], int(starts[-1]))


class LocalView:
    """A reader over the global index that reads only this rank's local samples.

    Args:
        local: the reader of this rank's files.
        begins: where each of ``local``'s files starts in the global index, in its order.
        counts: samples in each of ``local``'s files.
        num_samples: samples in the global index.
    """

    def __init__(self, local: Any, begins: Sequence[int], counts: Sequence[int], num_samples: int):
        self.local = local
        self.fields = local.fields
        self.format = getattr(local, "format", "")  # what ``datastore status`` shows
        begins, counts = np.asarray(begins, np.int64), np.asarray(counts, np.int64)
        order = np.argsort(begins, kind="stable")
        self._begin, self._count = begins[order], counts[order]
        self._local_start = _starts(counts)[:-1][order]  # where each starts in ``local``
        self._n = int(num_samples)

    @classmethod
    def of_names(
        cls,
        local: Any,
        names: list[str],
        local_names: list[str],
        counts: Sequence[int] | None = None,
    ) -> LocalView:
        """The view of ``local`` (the files ``local_names``, in its order) in the global index
        of the files ``names`` (``counts[k]`` samples in ``names[k]``; default: one each)."""
        counts = np.ones(len(names), np.int64) if counts is None else np.asarray(counts, np.int64)
        starts = _starts(counts)
        at = {n: k for k, n in enumerate(names)}
        mine = np.array([at[n] for n in local_names], dtype=np.int64)
        return cls(local, starts[mine], counts[mine], int(starts[-1]))

    def __len__(self) -> int:
        return self._n

    def read(self, index: int, field: str, region: Any = None, out: Any = None) -> np.ndarray:
        if not 0 <= index < self._n:
            raise ValueError(f"sample {index} out of range [0, {self._n})")
        k = int(np.searchsorted(self._begin, index, side="right")) - 1
        if k < 0 or index >= self._begin[k] + self._count[k]:
            raise ValueError(f"sample {index} is not on this node")
        local = int(self._local_start[k]) + index - int(self._begin[k])
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


def plan_shards(every: list[Listing]) -> tuple[list[str], np.ndarray, RunOwners] | None:
    """``(names, samples per name, owners)`` from every rank's ``Listing``, or ``None`` when
    some rank's dataset is not shardable or every rank holds the same files.

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


def shard_layout(reader: Any, root: str, comm: Any) -> tuple[LocalView, RunOwners] | None:
    """``(view, owners)`` when ranks hold different files of a shardable dataset, else ``None``.

    Collective over ``comm`` (a ``datastore.ranks.agree.Collective``): rank 0 gathers the listings
    and plans; every rank receives the owners as runs and where its own files start, never the
    other ranks' lists. Refuses (``ValueError``, on every rank) datasets whose formats, fields
    or file sample counts differ by node (:func:`plan_shards`).
    """
    local = local_files(reader, root)
    signature = {n: (str(f.dtype), tuple(f.shape)) for n, f in reader.fields.items()}
    fmt = getattr(reader, "format", None) if local is not None else None
    every = comm.gather((fmt, local or {}, signature))
    head: tuple[str | None, Any] = (None, None)
    begins: list[Any] | None = None
    if every is not None:  # rank 0
        try:
            plan = plan_shards(every)
        except ValueError as exc:
            plan, head = None, (str(exc), None)
        if plan is not None:
            names, counts, owner = plan
            starts = _starts(counts)
            at = {n: k for k, n in enumerate(names)}
            begins = [starts[[at[n] for n in held]] for _, held, _ in every]
            head = (None, (owner.starts, owner.ranks, owner.num_samples))
    error, runs = comm.bcast(head)
    if error is not None:
        raise ValueError(error)
    if runs is None:
        return None
    mine = comm.scatter(begins)
    owner = RunOwners(*runs)
    view = LocalView(reader, mine, list((local or {}).values()), owner.num_samples)
    return view, owner

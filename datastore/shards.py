"""Samples that live on some nodes only: the global index and owners of a sharded dataset.

After ``datastore stage --mode shard`` each node holds a share of a per-sample-file dataset
(``.npy``/``.npz`` files, one HDF5 file per sample) under the same path. Every rank lists its
local files (names relative to the dataset path) and all ranks exchange the lists. If they
differ, the dataset is sharded: the sorted union of the names is the global index (the same
order as one directory holding every file), a sample is owned by the ranks that have it
locally (split in contiguous ranges among them), and an owner reads only its own files through
``LocalView``. If every rank sees the same files, nothing changes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from datastore.order import contiguous_owners

__all__ = ["SHARDABLE", "LocalView", "owners_by_holders", "shard_layout"]

SHARDABLE = ("npy", "hdf5-per-sample")


def owners_by_holders(names: list[str], holders: list[list[str]]) -> np.ndarray:
    """The owner rank of every name in ``names`` (the sorted union of ``holders``).

    ``holders[r]`` lists the names rank ``r`` has locally. Ranks with the same list form a
    group (a node); each name goes to the first group holding it, and a group's names are split
    in contiguous, balanced ranges over its ranks.
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank, held in enumerate(holders):
        groups.setdefault(tuple(held), []).append(rank)
    index = {n: i for i, n in enumerate(names)}
    owner = np.full(len(names), -1, dtype=np.int64)
    for held, ranks in groups.items():
        mine = [index[n] for n in held if owner[index[n]] < 0]
        split = contiguous_owners(len(mine), len(ranks))
        for i, r in zip(mine, split, strict=True):
            owner[i] = ranks[r]
    return owner


class LocalView:
    """A reader over the global index that reads only this rank's local samples."""

    def __init__(self, local: Any, names: list[str], local_names: list[str]):
        self.local = local
        self.fields = local.fields
        self._names = names
        at = {n: i for i, n in enumerate(local_names)}
        self._local_index = {g: at[n] for g, n in enumerate(names) if n in at}

    def __len__(self) -> int:
        return len(self._names)

    def read(self, index: int, field: str, region: Any = None, out: Any = None) -> np.ndarray:
        local = self._local_index.get(index)
        if local is None:
            raise ValueError(f"sample {index} ({self._names[index]}) is not on this node")
        return self.local.read(local, field, region=region, out=out)

    def close(self) -> None:
        self.local.close()


def shard_layout(reader: Any, root: str, comm: Any) -> tuple[Any, np.ndarray] | None:
    """``(view, owner)`` when ranks hold different files of a shardable dataset, else ``None``.

    Collective over ``comm``. Refuses (``ValueError``) datasets whose fields differ by node.
    """
    shardable = getattr(reader, "format", None) in SHARDABLE and hasattr(reader, "files")
    local = sorted(os.path.relpath(f, root) for f in reader.files) if shardable else []
    signature = {n: (str(f.dtype), tuple(f.shape)) for n, f in reader.fields.items()}
    every = comm.allgather((shardable, local, signature))
    if not all(s for s, _, _ in every) or all(held == every[0][1] for _, held, _ in every):
        return None
    if any(sig != every[0][2] for _, _, sig in every):
        raise ValueError("the nodes' shards of the dataset have different fields or shapes")
    holders = [held for _, held, _ in every]
    names = sorted(set().union(*holders))
    return LocalView(reader, names, local), owners_by_holders(names, holders)

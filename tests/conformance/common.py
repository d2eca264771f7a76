"""What the conformance tests share: a dataset whose samples encode their index, the torch
loaders over the same file, and summaries of what a consumer saw."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from datastore import DataStoreLoader

__all__ = [
    "HERE",
    "PYTHON",
    "H5Samples",
    "counts",
    "epoch",
    "flat",
    "ids_of",
    "ours",
    "theirs",
    "valid_ids",
    "write_dataset",
]

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable


def write_dataset(path: str, n: int) -> str:
    """An HDF5 file of ``n`` samples: ``x`` (2, 2, 2) filled with the sample's index and
    ``idx``, the index itself, so a batch tells which samples it holds and that their bytes
    are right."""
    with h5py.File(path, "w") as f:
        f["x"] = np.broadcast_to(np.arange(n, dtype=np.float32)[:, None, None, None], (n, 2, 2, 2))
        f["idx"] = np.arange(n, dtype=np.int64)
    return path


class H5Samples(Dataset):
    """The same file as a map-style torch dataset: ``{"x", "idx"}`` per sample."""

    def __init__(self, path: str) -> None:
        self.path = path
        with h5py.File(path, "r") as f:
            self.n = len(f["idx"])
        self._file: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self._file is None:
            self._file = h5py.File(self.path, "r")
        return {"x": torch.from_numpy(self._file["x"][i]), "idx": torch.tensor(int(i))}


def theirs(
    path: str,
    batch_size: int,
    *,
    drop_last: bool = True,
    ranks: tuple[int, int] | None = None,
    stateful: bool = False,
    seed: int = 0,
) -> DataLoader:
    """torch's loader as its users write it: ``shuffle=True``; with ``ranks=(rank, world)`` a
    ``DistributedSampler``; ``stateful``: torchdata's ``StatefulDataLoader``."""
    ds = H5Samples(path)
    cls: Any = DataLoader
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        cls = StatefulDataLoader
    if ranks is None:
        gen = torch.Generator().manual_seed(seed)
        return cls(ds, batch_size=batch_size, shuffle=True, drop_last=drop_last, generator=gen)
    rank, world = ranks
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return cls(ds, batch_size=batch_size, sampler=sampler, drop_last=drop_last)


def ours(path: str, batch_size: int, **kw: Any) -> DataStoreLoader:
    """Ours over the same file, with the defaults (``shuffle=True``, ``drop_last=True``)."""
    return DataStoreLoader(path, batch_size=batch_size, seed=kw.pop("seed", 0), **kw)


def ids_of(batch: dict[str, torch.Tensor]) -> list[int]:
    """The sample indices of a batch, after checking its bytes encode the same ones."""
    idx = batch["idx"]
    assert torch.equal(batch["x"][:, 0, 0, 0], idx.to(torch.float32)), "bytes of another sample"
    return idx.tolist()


def valid_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """The real samples of a batch (ours marks padding repeats in ``valid``)."""
    ids = ids_of(batch)
    if "valid" not in batch:
        return ids
    return [i for i, v in zip(ids, batch["valid"].tolist(), strict=True) if v]


def epoch(batches: Iterable[dict[str, torch.Tensor]]) -> list[list[int]]:
    """The ids of every batch of one pass."""
    return [ids_of(b) for b in batches]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def counts(ids: Iterable[int]) -> Counter:
    return Counter(ids)

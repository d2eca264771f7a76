"""Which rank holds which samples, as runs of consecutive samples: never an entry per sample.

A run is a range of consecutive sample indices on one rank. The embedded exchange splits a
dataset in one contiguous range per rank (:class:`RangeOwners`: P runs); a dataset staged
with ``--mode shard`` has a run per stretch of files one node holds (:class:`RunOwners`: at
most files + ranks runs). Either costs O(runs) memory where an owner per sample costs 8 B per
sample (800 MB per rank for 10^8 samples).

:class:`Homes` says what each data-parallel rank draws its samples from when the shuffle stays
within a rank's shards (``shuffle="shard"`` or ``"window:K"``, ``datastore.maths.order``): the
samples its own ranks hold, in storage order.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Homes", "RangeOwners", "RunOwners", "contiguous_owners", "owned_keys"]

FEW = 64  # lookups of up to this many samples are made in Python


def contiguous_owners(num_samples: int, owners: int) -> np.ndarray:
    """The owner of every sample when ``owners`` ranks hold contiguous, balanced ranges (an
    array: for tests and small datasets; :class:`RangeOwners` is the same without the array).

    Contiguous ranges keep a rank's reads sequential in files with a sample axis; the first
    ``num_samples % owners`` owners hold one sample more.
    """
    return RangeOwners(num_samples, owners)[np.arange(num_samples)]


class RunOwners:
    """``owner[i]`` of every sample, stored as runs: run ``k`` is the samples
    ``[starts[k], starts[k + 1])`` (the last ends at ``num_samples``) on rank ``ranks[k]``.

    Adjacent runs of one rank are merged and empty ones dropped. Lookups are a binary search
    over the runs (for a few samples, a batch's, in Python: a numpy call costs more than that).

    Raises:
        ValueError: starts that do not begin at 0 or do not increase, or a negative rank.
    """

    def __init__(self, starts: Any, ranks: Any, num_samples: int) -> None:
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        ranks = np.asarray(ranks, dtype=np.int64).reshape(-1)
        if len(starts) != len(ranks) or (num_samples and (not len(starts) or starts[0] != 0)):
            raise ValueError("runs must start at sample 0, one rank per run")
        ends = np.append(starts[1:], num_samples)
        if np.any(ends < starts) or (len(ranks) and ranks.min() < 0):
            raise ValueError("run starts must not decrease and ranks must be >= 0")
        keep = ends > starts
        starts, ranks = starts[keep], ranks[keep]
        first = np.ones(len(starts), dtype=bool)
        first[1:] = ranks[1:] != ranks[:-1]
        self.starts, self.ranks = starts[first], ranks[first]
        self.num_samples = int(num_samples)
        self._starts, self._ranks = memoryview(self.starts), memoryview(self.ranks)

    @classmethod
    def of_array(cls, owner: Any) -> RunOwners:
        """The runs of an array of owners, one per sample."""
        owner = np.asarray(owner, dtype=np.int64).reshape(-1)
        first = np.flatnonzero(np.diff(owner, prepend=-1))
        return cls(first, owner[first], len(owner))

    def __len__(self) -> int:
        return self.num_samples

    @property
    def ends(self) -> np.ndarray:
        return np.append(self.starts[1:], self.num_samples)

    def __getitem__(self, index: Any) -> Any:
        """The owner of sample ``index`` (an int or an array of them)."""
        idx = np.asarray(index)
        if idx.ndim == 0:
            return self.owners_of([int(idx)])[0]
        if idx.size <= FEW:
            return np.asarray(self.owners_of(idx.reshape(-1).tolist()), np.int64).reshape(idx.shape)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"sample outside 0..{self.num_samples - 1}")
        owner = self.ranks[np.searchsorted(self.starts, idx, side="right") - 1]
        return int(owner) if np.ndim(owner) == 0 else owner

    def owners_of(self, samples: Sequence[int]) -> list[int]:
        """The owner of each of ``samples`` (Python ints), as a list."""
        n = self.num_samples
        if any(not 0 <= i < n for i in samples):
            raise IndexError(f"sample outside 0..{n - 1}")
        starts, ranks = self._starts, self._ranks
        return [ranks[bisect.bisect_right(starts, i) - 1] for i in samples]

    def keys_of(self, rank: int) -> np.ndarray:
        """The samples ``rank`` owns, in order."""
        mine = np.flatnonzero(self.ranks == rank)
        ends = self.ends
        return _ranges(self.starts[mine], ends[mine])

    def counts(self, ranks: int) -> np.ndarray:
        """How many samples each of ``ranks`` ranks owns."""
        return np.bincount(self.ranks, weights=self.ends - self.starts, minlength=ranks).astype(
            np.int64
        )


class RangeOwners(RunOwners):
    """Contiguous, balanced ranges on ``owners`` ranks (:func:`contiguous_owners`): O(ranks).

    With ``groups`` (data ranks of ``owners // groups`` spatial ranks each), the samples are
    first split into ``groups`` balanced ranges, each then over its group's ranks: a group's
    range is its home of :meth:`Homes.contiguous`, whatever the spatial blocks. Default: ``1``.
    """

    def __init__(self, num_samples: int, owners: int, groups: int = 1) -> None:
        if owners < 1 or groups < 1 or owners % groups:
            raise ValueError(f"owners must be a multiple >= 1 of {groups} groups, got {owners}")
        sizes = _balanced(_balanced(num_samples, groups), owners // groups).reshape(-1)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        super().__init__(starts, np.arange(owners), num_samples)


def _balanced(total: Any, parts: int) -> np.ndarray:
    """The sizes of ``parts`` contiguous ranges splitting each of ``total``, the first
    ``total % parts`` one larger: shape ``(*shape(total), parts)``."""
    total = np.asarray(total, dtype=np.int64)[..., None]
    return total // parts + (np.arange(parts) < total % parts)


def owned_keys(owner: Any, rank: int) -> np.ndarray:
    """The samples ``rank`` owns, from a :class:`RunOwners` or an array of owners."""
    if isinstance(owner, RunOwners):
        return owner.keys_of(rank)
    return np.flatnonzero(np.asarray(owner) == rank)


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, e)`` for each pair, without a Python loop."""
    lengths = ends - starts
    total = int(lengths.sum())
    out = np.ones(total, dtype=np.int64)
    if total == 0:
        return out
    nonempty = lengths > 0
    s, n = starts[nonempty], lengths[nonempty]
    heads = np.concatenate([[0], np.cumsum(n)[:-1]])
    out[heads[0]] = s[0]
    out[heads[1:]] = s[1:] - (s[:-1] + n[:-1] - 1)
    return np.cumsum(out)


class Homes:
    """What each of ``data_world`` data-parallel ranks draws from: data rank ``d``'s home is
    the samples owned by its ranks ``d * S .. d * S + S - 1`` (ranks spatial-fastest), in
    storage order.

    The homes together are a bijection of ``[0, N)`` onto itself: home index ``h`` (data rank
    ``d``'s ``j``-th sample is ``h = base[d] + j``) maps to :meth:`sample`. O(runs) memory.

    Args:
        owner: who holds each sample, as runs.
        data_world: data-parallel ranks.
        spatial_size: ranks per data rank (spatial blocks). Default: 1.
    """

    def __init__(self, owner: RunOwners, data_world: int, spatial_size: int = 1) -> None:
        if data_world < 1 or spatial_size < 1:
            raise ValueError("data_world and spatial_size must be >= 1")
        home = owner.ranks // spatial_size
        if home.size and home.max() >= data_world:
            raise ValueError(f"a sample's owner is outside the {data_world * spatial_size} ranks")
        order = np.lexsort((owner.starts, home))  # by data rank, then storage order
        lengths = (owner.ends - owner.starts)[order]
        self.data_world = data_world
        self.run_sample = owner.starts[order]  # the first sample of each run
        self.run_home = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        lengths_by_home = np.bincount(home, weights=owner.ends - owner.starts, minlength=data_world)
        self.sizes = lengths_by_home.astype(np.int64)
        self.base = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

    @classmethod
    def contiguous(cls, num_samples: int, data_world: int) -> Homes:
        """Balanced contiguous homes (each rank reads its own range; nobody holds the rest)."""
        return cls(RangeOwners(num_samples, data_world), data_world)

    def sample(self, data_rank: Any, index: Any) -> np.ndarray:
        """The sample at ``index`` (each in ``[0, sizes[d])``) of data rank ``data_rank``'s home."""
        h = self.base[np.asarray(data_rank)] + np.asarray(index, dtype=np.int64)
        k = np.searchsorted(self.run_home, h, side="right") - 1
        return self.run_sample[k] + (h - self.run_home[k])

    def keys_of(self, data_rank: int) -> np.ndarray:
        """Every sample of data rank ``data_rank``'s home, in storage order."""
        return self.sample(data_rank, np.arange(self.sizes[data_rank], dtype=np.int64))

    def digest(self) -> str:
        """A short fingerprint: equal for equal homes (saved with a resumable position)."""
        h = hashlib.blake2b(digest_size=8)
        for a in (self.sizes, self.run_sample, self.run_home):
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        return h.hexdigest()

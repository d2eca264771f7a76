"""The sample order: which samples each rank gets at every step, as pure functions.

The global order of an epoch is a function of ``(seed, epoch)`` alone: a permutation taken by
sorting 64-bit keys drawn from PCG64 (``random_raw`` of a ``SeedSequence([seed, epoch])``),
whose stream NumPy keeps stable across versions (unlike ``Generator.permutation``), so every
rank, node and NumPy version computes the same order without talking to the others.

Step ``s`` of an epoch is the global batch ``order[s*B:(s+1)*B]`` for a global batch of ``B``
samples. Data-parallel rank ``r`` of ``W`` takes the contiguous slice ``[r*B/W:(r+1)*B/W]`` of
it, so the sequence of global batches (and so of samples seen) is the same for any ``W`` that
divides ``B``: elastic determinism, as in MosaicML Streaming, with no canonical node count.

The tail of an epoch (``N mod B`` samples) is dropped (``tail="drop"``) or filled up with the
first samples of the same epoch's order (``tail="pad"``): either way every rank gets the same
number of equal batches, so no rank waits at a collective for a batch that never comes.

Resuming is O(1) in the number of batches seen: the state is ``(epoch, step)``; the epoch's
order is recomputed and iteration starts at ``step``, with nothing replayed.

Ranks of a hybrid job are numbered spatial-fastest: ``rank = data_rank * S + spatial_rank``
for ``S`` spatial blocks per sample (``rank_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "TAILS",
    "EpochPosition",
    "RankLayout",
    "Schedule",
    "check_state",
    "contiguous_owners",
    "epoch_order",
    "rank_layout",
    "state",
]

TAILS = ("drop", "pad")


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The permutation of ``range(num_samples)`` for ``epoch`` (identity when not shuffling)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    bits = np.random.PCG64(np.random.SeedSequence([seed & (2**63 - 1), epoch]))
    keys = bits.random_raw(num_samples)
    return np.argsort(keys, kind="stable").astype(np.int64)


@dataclass(frozen=True)
class Schedule:
    """Batches of an epoch for a dataset of ``num_samples`` and a global batch of ``global_batch``.

    Args:
        num_samples: samples in the dataset.
        global_batch: samples per step over all data-parallel ranks together.
        seed: the shuffle seed. Default: ``0``.
        shuffle: permute every epoch. Default: ``True``.
        tail: ``"drop"`` the last partial batch or ``"pad"`` it. Default: ``"drop"``.
    """

    num_samples: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    tail: str = "drop"

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"the dataset has no samples (num_samples={self.num_samples})")
        if self.global_batch < 1:
            raise ValueError(f"global batch size must be >= 1, got {self.global_batch}")
        if self.tail not in TAILS:
            raise ValueError(f"tail must be one of {', '.join(TAILS)}, got {self.tail!r}")
        if self.tail == "drop" and self.global_batch > self.num_samples:
            raise ValueError(
                f"global batch {self.global_batch} exceeds the {self.num_samples} samples: "
                "with tail='drop' an epoch would have no batch (use tail='pad')"
            )

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full + (1 if rest and self.tail == "pad" else 0)

    def order(self, epoch: int) -> np.ndarray:
        """Every sample of ``epoch`` in order, tail dropped or padded: ``steps * B`` indices."""
        perm = epoch_order(self.num_samples, self.seed, epoch, self.shuffle)
        need = self.steps_per_epoch * self.global_batch
        if need <= len(perm):
            return perm[:need]
        return np.concatenate([perm, np.resize(perm, need - len(perm))])

    def global_batch_at(self, epoch: int, step: int, order: np.ndarray | None = None) -> np.ndarray:
        """The ``B`` sample indices of ``step`` (pass ``order(epoch)`` to avoid recomputing it)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside 0..{self.steps_per_epoch - 1}")
        full = self.order(epoch) if order is None else order
        return full[step * self.global_batch : (step + 1) * self.global_batch]

    def local_batch(self, data_world: int) -> int:
        """Samples per step on each of ``data_world`` ranks; they must divide the global batch."""
        if data_world < 1 or self.global_batch % data_world:
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by {data_world} "
                "data-parallel ranks: every rank must get the same number of samples"
            )
        return self.global_batch // data_world

    def valid(self, step: int, data_rank: int, data_world: int) -> np.ndarray:
        """Which of data rank ``data_rank``'s samples at ``step`` are real (``True``) rather
        than the repeats that pad the epoch's last batch (``tail="pad"``)."""
        b = self.local_batch(data_world)
        first = step * self.global_batch + data_rank * b
        return np.arange(first, first + b) < self.num_samples

    def rank_batch(self, global_batch: np.ndarray, data_rank: int, data_world: int) -> np.ndarray:
        """Data rank ``data_rank``'s contiguous share of a global batch."""
        b = self.local_batch(data_world)
        return global_batch[data_rank * b : (data_rank + 1) * b]


@dataclass(frozen=True)
class RankLayout:
    """A rank of a hybrid job: ``data_rank`` of ``data_world``, block ``spatial_rank`` of ``S``."""

    rank: int
    world: int
    data_rank: int
    data_world: int
    spatial_rank: int
    spatial_size: int


def rank_layout(rank: int, world: int, spatial_size: int = 1) -> RankLayout:
    """Place ``rank`` of ``world`` in a data x spatial grid, spatial-fastest."""
    if spatial_size < 1 or world % spatial_size:
        raise ValueError(f"world size {world} is not a multiple of {spatial_size} spatial blocks")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    return RankLayout(
        rank, world, rank // spatial_size, world // spatial_size, rank % spatial_size, spatial_size
    )


def contiguous_owners(num_samples: int, owners: int) -> np.ndarray:
    """The owner of every sample when ``owners`` ranks hold contiguous, balanced ranges.

    Contiguous ranges keep a rank's reads sequential in files with a sample axis; the first
    ``num_samples % owners`` owners hold one sample more.
    """
    if owners < 1:
        raise ValueError(f"owners must be >= 1, got {owners}")
    sizes = np.full(owners, num_samples // owners, dtype=np.int64)
    sizes[: num_samples % owners] += 1
    return np.repeat(np.arange(owners, dtype=np.int64), sizes)


def state(schedule: Schedule, epoch: int, step: int) -> dict[str, Any]:
    """The resumable position: everything that fixes the sample sequence, plus where we are."""
    return {
        "version": 1,
        "epoch": epoch,
        "step": step,
        "num_samples": schedule.num_samples,
        "global_batch": schedule.global_batch,
        "seed": schedule.seed,
        "shuffle": schedule.shuffle,
        "tail": schedule.tail,
    }


def check_state(schedule: Schedule, saved: dict[str, Any]) -> tuple[int, int]:
    """``(epoch, step)`` of a saved state, refusing one that would change the sequence."""
    for key in ("num_samples", "global_batch", "seed", "shuffle", "tail"):
        if saved.get(key) != getattr(schedule, key):
            raise ValueError(
                f"cannot resume: saved {key}={saved.get(key)!r} but this loader has "
                f"{key}={getattr(schedule, key)!r} (the sample sequence would differ)"
            )
    epoch, step = int(saved["epoch"]), int(saved["step"])
    if not 0 <= step <= schedule.steps_per_epoch:
        raise ValueError(f"cannot resume: step {step} outside 0..{schedule.steps_per_epoch}")
    return epoch, step


class EpochPosition:
    """Where a loader is in its sequence: ``epoch`` and ``_step`` (the next batch) over
    ``schedule``. An epoch ends when its last batch is handed out, not when a ``for`` loop
    asks for one more: a consumer that stops after ``len(loader)`` batches (Lightning,
    ``islice``) still moves on to the next epoch."""

    schedule: Schedule
    epoch: int
    _step: int

    def __len__(self) -> int:
        return self.schedule.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration."""
        self.epoch, self._step = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch handed out; resuming from it is O(1)."""
        return state(self.schedule, self.epoch, self._step)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        epoch, step = check_state(self.schedule, saved)
        self.epoch, self._step = (
            (epoch + 1, 0)
            if step >= self.schedule.steps_per_epoch
            else (
                epoch,
                step,
            )
        )

    def _handed_out(self, step: int) -> None:
        """Batch ``step`` is with the consumer: the next one, or the next epoch's first."""
        self._step = step + 1
        if self._step >= self.schedule.steps_per_epoch:
            self.epoch, self._step = self.epoch + 1, 0

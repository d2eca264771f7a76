"""Moving samples (or blocks) from the ranks that own them to the ranks that consume them.

Every rank owns some samples (``owner[i]``). At each step, the consumer of ``(data_rank d,
block k)`` needs block ``k`` of each sample in ``d``'s share of the global batch. ``plan`` (a
pure function) lists the messages ``(src, dst, sample, block, position)`` of a step, sorted by
``(src, dst, position)``; :func:`rank_plan` lists only those a rank sends or receives, in the
same order, so sender and receiver agree on every message without talking about it.
:class:`EpochPlan` lists the same messages without looking at the global batch at all: what a
rank consumes is its own slice of the step, and what it sends comes from where its own samples
sit in the epoch (the inverse of the order, computed once per epoch for its N/P samples): the
epoch's messages of one rank are computed and sorted with array operations, O(N/P) per epoch,
not O(B) per step (O(N) per epoch), and a step's messages are a view of them
(:class:`StepMessages`, read as :class:`Message` objects).

The exchanges (``datastore.sources.mpi``, ``datastore.sources.torch_dist``) move them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from datastore.maths.order import RankLayout, Schedule

__all__ = ["EpochPlan", "Message", "StepMessages", "plan", "rank_plan"]


class Message(NamedTuple):
    """Block ``block`` of ``sample`` goes from rank ``src`` to rank ``dst``."""

    src: int
    dst: int
    sample: int
    block: int
    pos: int  # position of the sample in the consumer's batch


def plan(batch: np.ndarray, owner: np.ndarray, data_world: int, spatial_size: int) -> list[Message]:
    """All messages of one step, sorted by ``(src, dst, pos)``; ranks are spatial-fastest."""
    b = len(batch) // data_world
    out = []
    for d in range(data_world):
        for pos, sample in enumerate(batch[d * b : (d + 1) * b].tolist()):
            for k in range(spatial_size):
                out.append(Message(int(owner[sample]), d * spatial_size + k, sample, k, pos))
    out.sort(key=lambda m: (m.src, m.dst, m.pos))
    return out


def rank_plan(
    batch: np.ndarray, owner: np.ndarray, data_world: int, spatial_size: int, rank: int
) -> list[Message]:
    """The messages of :func:`plan` whose ``src`` or ``dst`` is ``rank``, in its order."""
    batch = np.asarray(batch, dtype=np.int64)
    b = len(batch) // data_world
    d, k = divmod(rank, spatial_size)
    owners = owner[batch]
    out = [  # what this rank consumes
        Message(int(o), rank, int(sample), k, pos)
        for pos, (sample, o) in enumerate(
            zip(
                batch[d * b : (d + 1) * b].tolist(),
                owners[d * b : (d + 1) * b].tolist(),
                strict=True,
            )
        )
    ]
    for i in np.flatnonzero(owners == rank).tolist():  # what it sends (to itself too)
        dd, pos = divmod(i, b)
        for kk in range(spatial_size):
            dst = dd * spatial_size + kk
            if dst != rank:
                out.append(Message(rank, dst, int(batch[i]), kk, pos))
    out.sort(key=lambda m: (m.src, m.dst, m.pos))
    return out


class StepMessages(Sequence[Message]):
    """One step's messages of a rank, in plan order, kept as columns: a :class:`Message` is
    made only when one is read. Compares equal to any sequence of the same messages."""

    __slots__ = ("columns",)

    def __init__(self, columns: np.ndarray) -> None:
        self.columns = columns  # (5, n) int64: src, dst, sample, block, pos

    def __len__(self) -> int:
        return self.columns.shape[1]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return StepMessages(self.columns[:, index])
        return Message(*self.columns[:, index].tolist())

    def __iter__(self) -> Iterator[Message]:
        return itertools.starmap(Message, self.columns.T.tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable columns: not hashable

    def __repr__(self) -> str:
        return f"StepMessages({list(self)!r})"


class EpochPlan:
    """:func:`rank_plan` of every step of ``epoch`` for ``layout``'s rank, which owns
    ``owned`` (its samples, by ``owner``), computed from its own share only.

    What the rank consumes is its slice of each step (:meth:`Schedule.rank_epoch`). With a
    global (or no) shuffle, what it sends comes from the positions of its own samples in the
    epoch (:meth:`Schedule.positions_of`, the inverse of the order); with homes
    (``shuffle="shard"``/``"window:K"``) a rank sends only within its data rank, whose slice
    of the step is all there is to look at. Both are computed once per epoch with array
    operations, O(N/P) time and memory (40 B kept per message: about 2 N/P messages for
    whole samples), and each step's messages are a slice of them (:class:`StepMessages`).
    """

    def __init__(
        self, schedule: Schedule, owner: Any, layout: RankLayout, epoch: int, owned: np.ndarray
    ) -> None:
        self.schedule, self.layout, self.epoch = schedule, layout, epoch
        b = schedule.local_batch(layout.data_world)
        mine = schedule.rank_epoch(epoch, layout.data_rank, layout.data_world)
        owners = np.asarray(owner[mine.reshape(-1)], dtype=np.int64).reshape(mine.shape)
        steps = mine.shape[0]
        consumed = (
            owners.reshape(-1), layout.rank, mine.reshape(-1), layout.spatial_rank,
            np.tile(np.arange(b, dtype=np.int64), steps),
            np.repeat(np.arange(steps, dtype=np.int64), b),
        )  # fmt: skip
        if schedule.homes is None:
            positions, samples = schedule.positions_of(epoch, owned)
            at_step, slot = np.divmod(positions, schedule.global_batch)
        else:  # homes: only this data rank's slice holds what it sends
            at_step, j = np.nonzero(owners == layout.rank)
            samples, slot = mine[at_step, j], j + layout.data_rank * b
        sent = _sent(at_step, samples, slot, b, layout)
        pieces = (consumed, sent)
        keys = np.concatenate([_plan_key(c, layout.rank, layout.world, b) for c in pieces])
        order = np.argsort(keys)  # the keys are unique: any sort gives one order
        sizes = (len(consumed[0]), len(sent[1]))  # (a send's src is one int: this rank)
        self._table = np.empty((5, len(order)), dtype=np.int64)  # src, dst, sample, block, pos
        for row in range(5):
            both = [np.broadcast_to(c[row], (n,)) for c, n in zip(pieces, sizes, strict=True)]
            np.take(np.concatenate(both), order, out=self._table[row])
        span = 2 * layout.world * b  # step s's keys are in [s * span, (s + 1) * span)
        self._bounds = np.searchsorted(keys[order], np.arange(steps + 1) * span)

    @property
    def steps(self) -> int:
        return len(self._bounds) - 1

    @property
    def nbytes(self) -> int:
        """Bytes this plan keeps."""
        return self._table.nbytes + self._bounds.nbytes

    def messages(self, step: int) -> StepMessages:
        """The messages ``layout``'s rank sends or receives at ``step``, as :func:`rank_plan`:
        O(1), a view of the epoch's plan."""
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} outside 0..{self.steps - 1}")
        return StepMessages(self._table[:, self._bounds[step] : self._bounds[step + 1]])


def _plan_key(columns: tuple[Any, ...], rank: int, world: int, b: int) -> np.ndarray:
    """One int64 per message of ``columns`` (``src, dst, sample, block, pos, step``) that
    sorts as ``(step, src, dst, pos)``: a message's ``src`` or ``dst`` is ``rank``, so
    ``(src, dst)`` takes ``2 * world`` values in order (``src`` below ``rank``, then ``rank``
    to each ``dst``, then ``src`` above). The key stays below ``2 * S * steps * B``, ``S``
    blocks per sample: far inside int64."""
    src, dst, _, _, pos, step = columns
    pair = np.where(src == rank, rank + dst, np.where(src < rank, src, src + world))
    return (step * (2 * world) + pair) * b + pos


def _sent(
    at_step: np.ndarray, samples: np.ndarray, slot: np.ndarray, b: int, layout: RankLayout
) -> tuple[Any, ...]:
    """The columns ``src, dst, sample, block, pos, step`` of what ``layout``'s rank sends:
    sample ``samples[i]`` at ``slot[i]`` of step ``at_step[i]`` (its place in the global batch)
    goes, block ``k`` of it, to every rank ``(d, k)`` of the slot's data rank ``d`` but
    itself."""
    s = layout.spatial_size
    d, pos = np.divmod(slot, b)
    block = np.tile(np.arange(s, dtype=np.int64), len(samples))
    dst = np.repeat(d, s) * s + block
    keep = dst != layout.rank
    return (
        layout.rank, dst[keep], np.repeat(samples, s)[keep], block[keep],
        np.repeat(pos, s)[keep], np.repeat(at_step, s)[keep],
    )  # fmt: skip

"""Moving samples (or blocks) from the ranks that own them to the ranks that consume them.

Every rank owns some samples (``owner[i]``). At each step, the consumer of ``(data_rank d,
block k)`` needs block ``k`` of each sample in ``d``'s share of the global batch. ``plan`` (a
pure function) lists the messages ``(src, dst, sample, block, position)`` of a step, sorted by
``(src, dst, position)``; :func:`rank_plan` lists only those a rank sends or receives, in the
same order, so sender and receiver agree on every message without talking about it.
:class:`EpochPlan` lists the same messages without looking at the global batch at all: what a
rank consumes is its own slice of the step, and what it sends comes from where its own samples
sit in the epoch (the inverse of the order, computed once per epoch for its N/P samples), so a
rank's plan costs O(N/P) per epoch, not O(B) per step (O(N) per epoch).

The exchanges (``datastore.sources.mpi``, ``datastore.sources.torch_dist``) move them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from datastore.order import RankLayout, Schedule

__all__ = ["EpochPlan", "Message", "plan", "rank_plan"]


@dataclass(frozen=True)
class Message:
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


class EpochPlan:
    """:func:`rank_plan` of every step of ``epoch`` for ``layout``'s rank, which owns
    ``owned`` (its samples, by ``owner``), computed from its own share only.

    With a global (or no) shuffle, the positions of the rank's samples in the epoch are
    computed once (:meth:`Schedule.positions_of`) and each step takes those inside it; with
    homes (``shuffle="shard"``/``"window:K"``) a rank sends only within its data rank, whose
    slice of the step is all there is to look at.
    """

    def __init__(
        self, schedule: Schedule, owner: Any, layout: RankLayout, epoch: int, owned: np.ndarray
    ) -> None:
        self.schedule, self.owner, self.layout, self.epoch = schedule, owner, layout, epoch
        self.b = schedule.local_batch(layout.data_world)
        # this rank's samples at every step, and their owners: O(N/R), once per epoch
        self.mine = schedule.rank_epoch(epoch, layout.data_rank, layout.data_world)
        self.owners = np.asarray(owner[self.mine.reshape(-1)]).reshape(self.mine.shape)
        self.positions = self.samples = None
        if schedule.homes is None:
            self.positions, self.samples = schedule.positions_of(epoch, owned)

    def messages(self, step: int) -> list[Message]:
        """The messages ``layout``'s rank sends or receives at ``step``, as :func:`rank_plan`."""
        lay, b, rank, s = self.layout, self.b, self.layout.rank, self.layout.spatial_size
        mine, owners = self.mine[step], self.owners[step]
        out = [  # what this rank consumes
            Message(o, rank, sample, lay.spatial_rank, pos)
            for pos, (sample, o) in enumerate(zip(mine.tolist(), owners.tolist(), strict=True))
        ]
        if self.positions is None:  # homes: only this data rank's slice holds what it sends
            here = np.flatnonzero(owners == rank)
            at, sent = here + lay.data_rank * b, mine[here]
        else:
            B = self.schedule.global_batch
            lo, hi = np.searchsorted(self.positions, [step * B, (step + 1) * B])
            at, sent = self.positions[lo:hi] - step * B, self.samples[lo:hi]
        for i, sample in zip(at.tolist(), sent.tolist(), strict=True):
            dd, pos = divmod(i, b)
            for kk in range(s):
                dst = dd * s + kk
                if dst != rank:
                    out.append(Message(rank, dst, sample, kk, pos))
        out.sort(key=lambda m: (m.src, m.dst, m.pos))
        return out

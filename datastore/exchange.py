"""Moving samples (or blocks) from the ranks that own them to the ranks that consume them.

Every rank owns some samples (``owner[i]``). At each step, the consumer of ``(data_rank d,
block k)`` needs block ``k`` of each sample in ``d``'s share of the global batch. ``plan`` (a
pure function) lists the messages ``(src, dst, sample, block, position)`` of a step, sorted by
``(src, dst, position)``; :func:`rank_plan` lists only those a rank sends or receives, in the
same order, so sender and receiver agree on every message without talking about it. A rank's
plan costs O(B) array work and a Python object per message of its own (its share of the batch
and what it sends), not one per message of the whole step.

The exchanges (``datastore.sources.mpi``, ``datastore.sources.torch_dist``) move them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Message", "plan", "rank_plan"]


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

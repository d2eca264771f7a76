"""Moving samples (or blocks) from the ranks that own them to the ranks that consume them.

Every rank owns some samples (``owner[i]``). At each step, the consumer of ``(data_rank d,
block k)`` needs block ``k`` of each sample in ``d``'s share of the global batch. ``plan`` (a
pure function) lists every message ``(src, dst, sample, block, position)`` of a step; each rank
filters its sends and receives from the same list, in the same order, so sender and receiver
agree on every message without talking about it.

The exchanges (``datastore.sources.mpi``, ``datastore.sources.torch_dist``) move them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Message", "plan"]


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

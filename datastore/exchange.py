"""Moving samples (or blocks) from the ranks that own them to the ranks that consume them.

Every rank owns some samples (``owner[i]``). At each step, the consumer of ``(data_rank d,
block k)`` needs block ``k`` of each sample in ``d``'s share of the global batch. ``plan`` (a
pure function) lists every message ``(src, dst, sample, block, position)`` of a step; each rank
filters its sends and receives from the same list, in the same order, so sender and receiver
agree on every message without talking about it.

``Exchange.step`` moves them with non-blocking point-to-point calls (buffer-based, no pickles)
and no staging copies of ours: a block is described to MPI as a subarray of the stored sample
(``Create_subarray``), so it is sent straight from the store, and it is received straight into
its place in the batch buffer (the zero halo of a block at the volume's edge is never written,
so it stays zero). A consumer of block ``k`` receives only block ``k``. What a rank owns and
consumes itself is copied directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Exchange", "Message", "Part", "plan"]


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


@dataclass(frozen=True)
class Part:
    """A box inside a C-ordered array: ``array[starts[i]:starts[i]+sizes[i], ...]``."""

    array: np.ndarray
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.sizes, dtype=np.int64)) * self.array.itemsize


# ``sources(sample, k)``: for each field, the Part of the stored sample that block k is made of.
# ``targets(pos)``: for each field, the Part of the batch buffer that receives it.
# ``local(sample, k, pos)``: copy block k of an owned sample into position pos directly.
Sources = Callable[[int, int], list[Part]]
Targets = Callable[[int], list[Part]]
Local = Callable[[int, int, int], None]


class Exchange:
    """Non-blocking sends and receives per step over a private duplicate of ``comm``."""

    def __init__(
        self,
        comm: Any,
        owner: np.ndarray,
        data_world: int,
        spatial_size: int,
        sources: Sources,
        targets: Targets,
        local: Local,
    ):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm.Dup()  # our messages never mix with the caller's
        self.rank = self.comm.Get_rank()
        self.owner, self.data_world, self.spatial_size = owner, data_world, spatial_size
        self.sources, self.targets, self.local = sources, targets, local
        self._types: dict[tuple, Any] = {}
        self.bytes_sent = 0
        self.seconds = 0.0  # time spent in step()

    def _type(self, part: Part) -> Any:
        """A committed MPI subarray type for ``part`` (bytes on the last axis), cached."""
        shape, item = part.array.shape, part.array.itemsize
        key = (shape, part.starts, part.sizes, item)
        t = self._types.get(key)
        if t is None:
            if not shape:  # a 0-d field: just its bytes
                t = self._mpi.BYTE.Create_contiguous(item)
            else:
                full = [*shape[:-1], shape[-1] * item]
                sub = [*part.sizes[:-1], part.sizes[-1] * item]
                starts = [*part.starts[:-1], part.starts[-1] * item]
                t = self._mpi.BYTE.Create_subarray(full, sub, starts)
            t.Commit()
            self._types[key] = t
        return t

    def agree_to_stop(self, stop: bool) -> bool:
        """True when any rank wants to stop: every rank then stops at the same step."""
        return bool(self.comm.allreduce(int(stop), op=self._mpi.MAX))

    def step(self, batch: np.ndarray) -> None:
        """Deliver this rank's share of ``batch`` (a global batch) into its batch buffers."""
        t0 = time.perf_counter()
        me = self.rank
        requests, keep = [], []
        msgs = plan(batch, self.owner, self.data_world, self.spatial_size)
        for m in msgs:  # receives first, in plan order (MPI matches same-pair messages in order)
            if m.dst == me and m.src != me:
                for part in self.targets(m.pos):
                    requests.append(self.comm.Irecv([part.array, 1, self._type(part)], m.src))
        for m in msgs:
            if m.src == me and m.dst != me:
                for part in self.sources(m.sample, m.block):
                    keep.append(part.array)
                    requests.append(self.comm.Isend([part.array, 1, self._type(part)], m.dst))
                    self.bytes_sent += part.nbytes
        for m in msgs:
            if m.src == me and m.dst == me:
                self.local(m.sample, m.block, m.pos)
        self._mpi.Request.Waitall(requests)
        self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        for t in self._types.values():
            t.Free()
        self._types.clear()
        self.comm.Free()

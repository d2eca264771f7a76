"""Moving samples (or blocks) from the ranks that own them to the ranks that consume them.

Every rank owns some samples (``owner[i]``). At each step, the consumer of ``(data_rank d,
block k)`` needs block ``k`` of each sample in ``d``'s share of the global batch. ``plan`` (a
pure function) lists every message ``(src, dst, sample, block, position)`` of a step; each rank
filters its sends and receives from the same list, in the same order, so sender and receiver
agree on the layout of every byte without talking about it.

``Exchange.step`` sends all of a step in one ``Alltoallv`` over reused byte buffers (buffer
calls, not pickles), copies what it owns itself directly, and unpacks what arrives straight
into the batch arrays. A consumer of block ``k`` receives only block ``k``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Exchange", "Message", "plan"]


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


# ``block_bytes(k)``: bytes of one sample's block k, all fields together, in field order.
# ``pack(sample, k, out)``: write that block's bytes into ``out`` (a uint8 view).
# ``unpack(pos, data)``: place one received block (uint8 view) at ``pos`` of the batch.
BlockBytes = Callable[[int], int]
Pack = Callable[[int, int, np.ndarray], None]
Unpack = Callable[[int, np.ndarray], None]


class Exchange:
    """One ``Alltoallv`` per step over a private duplicate of ``comm``."""

    def __init__(
        self,
        comm,
        owner: np.ndarray,
        data_world: int,
        spatial_size: int,
        block_bytes: BlockBytes,
        pack: Pack,
        unpack: Unpack,
    ):
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm.Dup()  # our collectives never interleave with the caller's
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.owner, self.data_world, self.spatial_size = owner, data_world, spatial_size
        self.block_bytes, self.pack, self.unpack = block_bytes, pack, unpack
        self._send = np.empty(0, np.uint8)
        self._recv = np.empty(0, np.uint8)
        self.bytes_sent = 0
        self.seconds = 0.0  # time spent in step(): packing, Alltoallv, unpacking

    @staticmethod
    def _grow(buf: np.ndarray, n: int) -> np.ndarray:
        return buf if len(buf) >= n else np.empty(max(n, 2 * len(buf)), np.uint8)

    def agree_to_stop(self, stop: bool) -> bool:
        """True when any rank wants to stop: every rank then stops at the same step."""
        return bool(self.comm.allreduce(int(stop), op=self._mpi.MAX))

    def step(self, batch: np.ndarray) -> None:
        """Deliver this rank's share of ``batch`` (a global batch) through ``unpack``."""
        t0 = time.perf_counter()
        msgs = plan(batch, self.owner, self.data_world, self.spatial_size)
        me = self.rank
        sends = [m for m in msgs if m.src == me and m.dst != me]
        recvs = [m for m in msgs if m.dst == me and m.src != me]
        for m in msgs:  # what this rank owns and consumes itself: no MPI
            if m.src == me and m.dst == me:
                n = self.block_bytes(m.block)
                self._send = self._grow(self._send, n)
                self.pack(m.sample, m.block, self._send[:n])
                self.unpack(m.pos, self._send[:n])
        scount = np.zeros(self.size, np.int64)
        rcount = np.zeros(self.size, np.int64)
        for m in sends:
            scount[m.dst] += self.block_bytes(m.block)
        for m in recvs:
            rcount[m.src] += self.block_bytes(m.block)
        sdispl = np.concatenate([[0], np.cumsum(scount)[:-1]])
        rdispl = np.concatenate([[0], np.cumsum(rcount)[:-1]])
        self._send = self._grow(self._send, int(scount.sum()))
        self._recv = self._grow(self._recv, int(rcount.sum()))
        off = sdispl.copy()
        for m in sends:  # sorted by (dst, pos): the receiver expects this order
            n = self.block_bytes(m.block)
            self.pack(m.sample, m.block, self._send[off[m.dst] : off[m.dst] + n])
            off[m.dst] += n
        byte = self._mpi.BYTE
        self.comm.Alltoallv(
            [self._send, (scount, sdispl), byte], [self._recv, (rcount, rdispl), byte]
        )
        off = rdispl.copy()
        for m in recvs:
            n = self.block_bytes(m.block)
            self.unpack(m.pos, self._recv[off[m.src] : off[m.src] + n])
            off[m.src] += n
        self.bytes_sent += int(scount.sum())
        self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        self.comm.Free()

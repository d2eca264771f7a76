"""The exchange over ``torch.distributed`` (gloo): the MPI exchange's messages under torchrun.

Without MPI (torchrun, or any launcher that only sets up ``torch.distributed``) the ranks still
hold the dataset once between them: the same ``plan()`` as the MPI exchange, as gloo
``isend``/``irecv`` of CPU tensors. An owner packs the part of each stored sample that a
consumer's box covers into one contiguous tensor and sends it; the consumer receives it into a
contiguous tensor and copies it into its place in the batch buffer, zeroing the halo outside
the volume. gloo matches messages between two ranks in order, as MPI does, and every message
of a step carries the step's tag. Every wait has a deadline (gloo completes a point-to-point
transfer inside ``wait``, which takes a timeout); a timeout names the step and the ranks still
awaited.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from datastore.agree import timeout_error
from datastore.delivery import Copy, Delivered, Gather, covered, pad_copies
from datastore.errors import DataStoreError
from datastore.ring import torch_dtype
from datastore.sources.owners import Owners
from datastore.store import Store

__all__ = ["TorchExchange", "gloo_group"]

_GLOO: dict[int, Any] = {}  # a gloo group made for a non-gloo default group, per default group


def gloo_group(group: Any = None) -> Any:
    """The group to exchange CPU tensors over: ``group`` if given, else the default group when
    its backend is gloo, else a gloo group over every rank (made once; collective)."""
    if group is not None:
        return group
    default = dist.group.WORLD
    if dist.get_backend() == "gloo":
        return default
    key = id(default)
    if key not in _GLOO:
        _GLOO[key] = dist.new_group(backend="gloo")
    return _GLOO[key]


class TorchExchange(Owners):
    """The MPI exchange's messages as gloo point-to-point calls within ``group``.

    Args:
        group: a gloo-capable ``torch.distributed`` group (:func:`gloo_group`).
        owner, data_world, spatial_size, store, fields, gather, timeout: as
            :class:`~datastore.sources.mpi.MpiExchange`; ranks are the group's ranks.
    """

    kind = "torch.distributed"

    def __init__(
        self,
        group: Any,
        owner: np.ndarray,
        data_world: int,
        spatial_size: int,
        store: Store,
        fields: dict[int, list[Delivered]],
        gather: Gather,
        timeout: float,
    ) -> None:
        self.group = group
        args = (owner, data_world, spatial_size, store, fields, gather, timeout)
        super().__init__(dist.get_rank(group), *args)

    def _peer(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (what ``isend``/``irecv`` take)."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def step(self, step: int, batch: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Deliver this rank's share of global ``batch`` into ``out`` (whole boxes, zero halo
        included); :class:`~datastore.errors.ExchangeTimeout` names the step and the peers if
        the messages do not arrive within the timeout."""
        t0 = time.perf_counter()
        me, tag = self.rank, step % 32768
        works: list[tuple[Any, int]] = []
        received: list[tuple[np.ndarray, torch.Tensor]] = []
        copies: list[Copy] = []
        keep: list[torch.Tensor] = []
        msgs = self.messages(batch)
        for m in msgs:
            if m.dst == me and m.src != me:
                for f in self.mine:
                    dst = out[f.name][m.pos, ...]
                    _, inner = covered(f)
                    room = torch.empty(dst[(*inner, ...)].shape, dtype=torch_dtype(f.dtype))
                    work = dist.irecv(room, self._peer(m.src), group=self.group, tag=tag)
                    works.append((work, m.src))
                    received.append((dst[(*inner, ...)], room))
                    copies.extend(pad_copies(f, dst))
        for m in msgs:
            if m.src == me and m.dst != me:
                for f in self.fields[m.block]:
                    src, _ = covered(f)
                    packed = torch.from_numpy(
                        np.ascontiguousarray(self.store.get(m.sample, f.name)[(*src, ...)])
                    )
                    keep.append(packed)
                    work = dist.isend(packed, self._peer(m.dst), group=self.group, tag=tag)
                    works.append((work, m.dst))
                    self.bytes_sent += packed.numel() * packed.element_size()
        copies.extend(self.own_copies(msgs, out))
        self._wait(works, step, time.monotonic() + self.timeout)
        copies.extend((dst, room.numpy()) for dst, room in received)
        self.gather.run(copies)
        self.seconds += time.perf_counter() - t0

    def _wait(self, works: list[tuple[Any, int]], step: int, deadline: float) -> None:
        """Wait for every message until ``deadline`` (gloo completes a point-to-point work only
        in ``wait``, which takes a timeout); name the ranks still awaited."""
        for i, (work, peer) in enumerate(works):
            left = max(0.001, deadline - time.monotonic())
            try:
                work.wait(timedelta(seconds=left))
            except RuntimeError as exc:
                peers = tuple(sorted({p for _, p in works[i:]}))
                if "Timed out" in str(exc):
                    raise timeout_error("the torch.distributed exchange", step, peers) from None
                raise DataStoreError(
                    f"the torch.distributed exchange at step {step} failed with rank {peer}: "
                    f"{' '.join(str(exc).split())}"
                ) from None

    def close(self) -> None:
        """Nothing to free: the group is the caller's (or shared by every loader)."""

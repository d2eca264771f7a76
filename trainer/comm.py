"""Every message of the trainer, on CPU or device tensors, over NCCL or gloo, with a timeout.

One place decides how a tensor travels:

- **direct**: the backend moves the tensor where it lies: gloo for CPU tensors, NCCL for CUDA
  tensors. Point-to-point transfers are posted together (``batch_isend_irecv`` on NCCL).
- **staged**: a CUDA tensor over gloo (ranks sharing one GPU, where NCCL refuses "Duplicate GPU
  detected", or a cluster without NCCL). gloo cannot send device memory (``isend`` of a CUDA
  tensor fails in ``writev``), so the tensor is copied into page-locked host memory, travels
  there, and the result is copied back to the device without blocking the host.

Waits: gloo applies no timeout to point-to-point waits, so every gloo wait passes ``timeout``;
an NCCL ``wait()`` only makes the current CUDA stream wait (the host runs on, which is what
lets communication overlap compute), and NCCL's own watchdog ends a collective after the
process group's timeout (``init_distributed(timeout=...)``).

A :class:`Pending` is a started operation; ``wait()`` finishes it (the staged copies back
included). Starting, then computing, then waiting is how the halo exchange and the gradient
buckets overlap with compute.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Pending",
    "all_gather",
    "all_reduce_sum",
    "backend_of",
    "broadcast",
    "exchange",
    "is_staged",
    "start_all_reduce",
    "start_exchange",
]

Message = tuple[int, torch.Tensor, int]
"""``(peer group rank, tensor, tag)`` of one point-to-point transfer."""


def backend_of(group: Any) -> str:
    """``"nccl"``, ``"gloo"``, ... of ``group`` (``None``: the default group)."""
    return str(dist.get_backend(group)).lower()


def is_staged(t: torch.Tensor, group: Any) -> bool:
    """Whether ``t`` must travel through host memory over ``group`` (a CUDA tensor on gloo)."""
    return t.is_cuda and backend_of(group) != "nccl"


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of device tensor ``t`` (blocking: gloo reads it next)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t)
    return host


def _host_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


@dataclass(eq=False)
class Pending:
    """Started transfers; :meth:`wait` finishes them (copies staged results back to the device).

    Attributes:
        works: the ``torch.distributed`` work handles.
        nccl: whether they run on NCCL (waits then order the CUDA stream, not the host).
        timeout: for gloo waits.
        back: ``(host, device)`` pairs: copy ``host`` into ``device`` once the works are done.
        keep: tensors that must live until the transfers end (send buffers).
    """

    works: list[Any]
    nccl: bool
    timeout: datetime.timedelta
    back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    def wait(self) -> None:
        """Wait for every transfer (raises after the timeout on gloo); idempotent."""
        if self.done:
            return
        for w in self.works:
            if self.nccl:
                w.wait()
            else:
                w.wait(self.timeout)
        for host, device in self.back:
            device.copy_(host, non_blocking=True)  # pinned memory: the allocator keeps it alive
        self.done = True
        self.works, self.back, self.keep = [], [], []


def start_all_reduce(
    t: torch.Tensor, group: Any, timeout: datetime.timedelta, op: Any = dist.ReduceOp.SUM
) -> Pending:
    """Start reducing ``t`` in place over ``group``; the result is in ``t`` after ``wait()``."""
    nccl = backend_of(group) == "nccl"
    if is_staged(t, group):
        host = _host_copy(t)
        return Pending([dist.all_reduce(host, op=op, group=group, async_op=True)], False, timeout,
                       back=[(host, t)])  # fmt: skip
    return Pending([dist.all_reduce(t, op=op, group=group, async_op=True)], nccl, timeout)


def all_reduce_sum(t: torch.Tensor, group: Any, timeout: datetime.timedelta) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place and return it; waits at most ``timeout``."""
    start_all_reduce(t, group, timeout).wait()
    return t


def all_gather(t: torch.Tensor, group: Any, timeout: datetime.timedelta) -> list[torch.Tensor]:
    """``t`` of every rank of ``group``, by group rank (equal shapes); waits at most ``timeout``."""
    t = t.contiguous()
    n = dist.get_world_size(group)
    if is_staged(t, group):
        host = _host_copy(t)
        got = [_host_like(t) for _ in range(n)]
        dist.all_gather(got, host, group=group, async_op=True).wait(timeout)
        return [g.to(t.device, non_blocking=True) for g in got]
    out = [torch.empty_like(t) for _ in range(n)]
    pending = Pending(
        [dist.all_gather(out, t, group=group, async_op=True)], backend_of(group) == "nccl", timeout
    )
    pending.wait()
    return out


def broadcast(t: torch.Tensor, src: int, group: Any, timeout: datetime.timedelta) -> None:
    """Overwrite ``t`` with global rank ``src``'s ``t`` on every rank of ``group``."""
    if is_staged(t, group):
        host = _host_copy(t)
        dist.broadcast(host, src=src, group=group, async_op=True).wait(timeout)
        t.copy_(host)
        return
    work = dist.broadcast(t, src=src, group=group, async_op=True)
    Pending([work], backend_of(group) == "nccl", timeout).wait()


def start_exchange(
    sends: Sequence[Message],
    recvs: Sequence[Message],
    group: Any,
    timeout: datetime.timedelta,
) -> Pending:
    """Post every send and receive at once; received data is in the ``recvs`` tensors after
    ``wait()``. Posting both directions before waiting cannot deadlock.

    Args:
        sends: ``(peer, tensor, tag)``: send ``tensor`` (contiguous) to group rank ``peer``.
        recvs: ``(peer, tensor, tag)``: receive into ``tensor`` (contiguous) from ``peer``.
        group: the process group the peers are ranks of.
        timeout: for gloo waits.

    Tags tell apart several messages between one pair on gloo; NCCL ignores them and matches a
    pair's messages in posting order, which is the same on both sides when every rank posts
    its messages in one agreed order (as the halo exchange does).
    """
    if not sends and not recvs:
        return Pending([], False, timeout)
    sample = (sends or recvs)[0][1]
    nccl = backend_of(group) == "nccl"
    if nccl:
        ops = [dist.P2POp(dist.irecv, t, None, group, tag, p) for p, t, tag in recvs]
        ops += [dist.P2POp(dist.isend, t, None, group, tag, p) for p, t, tag in sends]
        return Pending(dist.batch_isend_irecv(ops), True, timeout, keep=[t for _, t, _ in sends])
    staged = is_staged(sample, group)
    works, back, keep = [], [], []
    for peer, t, tag in recvs:
        buf = _host_like(t) if staged else t
        if staged:
            back.append((buf, t))
        works.append(dist.irecv(buf, group=group, group_src=peer, tag=tag))
    for peer, t, tag in sends:
        buf = _host_copy(t) if staged else t
        keep.append(buf)
        works.append(dist.isend(buf, group=group, group_dst=peer, tag=tag))
    return Pending(works, False, timeout, back=back, keep=keep)


def exchange(
    sends: Sequence[Message], recvs: Sequence[Message], group: Any, timeout: datetime.timedelta
) -> None:
    """:func:`start_exchange` and wait for it."""
    start_exchange(sends, recvs, group, timeout).wait()

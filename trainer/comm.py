"""Every message of the trainer, on CPU or device tensors, over NCCL or gloo, with a timeout.

One place decides how a tensor travels:

- **direct**: the backend moves the tensor where it lies: gloo for CPU tensors, NCCL for CUDA
  tensors. Point-to-point transfers are posted together (``batch_isend_irecv`` on NCCL).
- **staged**: a CUDA tensor over gloo (ranks sharing one GPU, where NCCL refuses "Duplicate GPU
  detected", or a cluster without NCCL). gloo cannot send device memory (``isend`` of a CUDA
  tensor fails in ``writev``), so the tensor is copied into page-locked host memory, travels
  there, and the result is copied back to the device without blocking the host.

Waits: gloo applies no timeout to point-to-point waits, so every gloo wait passes ``timeout``
(past it, :class:`~datastore.errors.ExchangeTimeout`; a connection a peer closed by exiting or
dying, :class:`~datastore.errors.PeerFailed`: one line each, not gloo's traceback);
an NCCL ``wait()`` only makes the current CUDA stream wait (the host runs on, which is what
lets communication overlap compute), and NCCL's own watchdog ends a collective after the
process group's timeout (``init_distributed(timeout=...)``).

A :class:`Pending` is a started operation; ``wait()`` finishes it (the staged copies back
included). Starting, then computing, then waiting is how the halo exchange and the gradient
buckets overlap with compute.

Timing: :data:`comm_clock` (off unless a benchmark turns it on; no cost then) says where the
communication cost time, by operation: host seconds blocked in gloo waits and in the staged
device-to-host copies (``time.perf_counter``), and on the device, from CUDA events on the
stream that computes (the current stream): how long that stream stalls in NCCL waits (events
just before and after ``Work.wait()``, which only makes the stream wait for NCCL's: this stall
is the exposed communication on NCCL, which the host clock cannot see) and how long the staged
copies run; plus each NCCL transfer's time on NCCL's own stream (``Work._get_duration()``, CUDA
events NCCL records when ``TORCH_NCCL_ENABLE_TIMING=1`` is set before the group starts).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from datastore.errors import ExchangeTimeout, PeerFailed
from datastore.ranks.agree import gloo_timed_out

__all__ = [
    "CommClock",
    "CommTimes",
    "Pending",
    "all_gather",
    "all_reduce_sum",
    "backend_of",
    "broadcast",
    "comm_clock",
    "exchange",
    "gloo_failures",
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


@dataclass
class CommTimes:
    """Seconds one kind of operation cost since :meth:`CommClock.start` (module docstring).

    Attributes:
        waits: ``Pending.wait`` calls.
        host_wait_s: host blocked in gloo waits (host clock).
        host_copy_s: host blocked in staged device-to-host copies, which first wait for the
            stream's earlier work (host clock).
        stall_s: the current stream held up in NCCL waits (CUDA events): exposed communication.
        nccl_s: the transfers on NCCL's stream (NCCL's CUDA events; 0 without
            ``TORCH_NCCL_ENABLE_TIMING=1``).
        nccl_timed: transfers ``nccl_s`` counts.
        to_host_s, to_device_s: the staged copies on the device (CUDA events).
    """

    waits: int = 0
    host_wait_s: float = 0.0
    host_copy_s: float = 0.0
    stall_s: float = 0.0
    nccl_s: float = 0.0
    nccl_timed: int = 0
    to_host_s: float = 0.0
    to_device_s: float = 0.0


class CommClock:
    """Where communication costs time (module docstring), per operation kind:
    ``"exchange"``, ``"all_reduce"``, ``"all_gather"``, ``"broadcast"``.

    ``start()`` zeroes and turns it on, ``stop()`` turns it off, ``read()`` waits for the
    device (the CUDA events) and returns the totals so far. Off, it records nothing.
    """

    def __init__(self) -> None:
        self.on = False
        self._times: dict[str, CommTimes] = {}
        self._spans: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []
        self._works: list[tuple[str, Any]] = []

    def start(self) -> None:
        """Zero every total and record from now on."""
        self.on = True
        self._times, self._spans, self._works = {}, [], []

    def stop(self) -> None:
        """Record nothing more (the totals stay readable)."""
        self.on = False

    def times(self, kind: str) -> CommTimes:
        """``kind``'s totals, a zero one the first time (for the recording code)."""
        return self._times.setdefault(kind, CommTimes())

    @contextmanager
    def host(self, kind: str, what: str) -> Iterator[None]:
        """Add the host seconds of the block to ``kind``'s ``what`` (a CommTimes field)."""
        if not self.on:
            yield
            return
        start = time.perf_counter()
        yield
        t = self.times(kind)
        setattr(t, what, getattr(t, what) + time.perf_counter() - start)

    @contextmanager
    def device(self, kind: str, what: str, on: torch.device | None) -> Iterator[None]:
        """Add the device time between CUDA events recorded on the current stream of GPU
        ``on`` before and after the block to ``kind``'s ``what``; nothing if ``on`` is None."""
        if not self.on or on is None:
            yield
            return
        stream = torch.cuda.current_stream(on)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        yield
        after.record(stream)
        self._spans.append((kind, what, before, after))

    def nccl_works(self, kind: str, works: Sequence[Any]) -> None:
        """Keep NCCL works to read their time on NCCL's stream in :meth:`read`."""
        if self.on:
            self._works += [(kind, w) for w in works]

    def read(self) -> dict[str, CommTimes]:
        """The totals since :meth:`start`, by kind (waits for the recorded CUDA events)."""
        for kind, what, before, after in self._spans:
            after.synchronize()  # after an NCCL wait's span, that transfer is done too
            t = self.times(kind)
            setattr(t, what, getattr(t, what) + before.elapsed_time(after) / 1e3)
        for kind, work in self._works:
            try:
                ms = work._get_duration()  # NCCL's start and end events on its stream
            except RuntimeError:  # timing not enabled, or not NCCL
                continue
            t = self.times(kind)
            t.nccl_s += ms / 1e3
            t.nccl_timed += 1
        self._spans, self._works = [], []
        return {k: CommTimes(**vars(v)) for k, v in self._times.items()}


comm_clock = CommClock()
"""The process-wide clock of every operation of this module (see the module docstring)."""


def _cuda(t: torch.Tensor) -> torch.device | None:
    return t.device if t.is_cuda else None


def _host_copy(t: torch.Tensor, kind: str) -> torch.Tensor:
    """A page-locked host copy of device tensor ``t`` (blocking: gloo reads it next)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with comm_clock.host(kind, "host_copy_s"), comm_clock.device(kind, "to_host_s", t.device):
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
        kind: the operation, for :data:`comm_clock`.
        device: the GPU whose current stream the waits order (NCCL) or the copies back run on
            (staged), for :data:`comm_clock`; ``None`` for CPU tensors.
    """

    works: list[Any]
    nccl: bool
    timeout: datetime.timedelta
    back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    kind: str = "exchange"
    device: torch.device | None = None
    done: bool = False

    def wait(self) -> None:
        """Wait for every transfer (raises after the timeout on gloo); idempotent."""
        if self.done:
            return
        if comm_clock.on and self.works:
            comm_clock.times(self.kind).waits += 1
        if self.nccl:
            with comm_clock.device(self.kind, "stall_s", self.device):  # waits for NCCL's
                for w in self.works:
                    w.wait()
            comm_clock.nccl_works(self.kind, self.works)
        else:
            with comm_clock.host(self.kind, "host_wait_s"), gloo_failures(self.kind, self.timeout):
                for w in self.works:
                    w.wait(self.timeout)
        with comm_clock.device(self.kind, "to_device_s", self.device if self.back else None):
            for host, device in self.back:
                device.copy_(host, non_blocking=True)  # pinned: the allocator keeps it alive
        self.done = True
        self.works, self.back, self.keep = [], [], []


_CLOSED = ("Connection closed", "Connection reset")  # gloo: the peer exited or was killed


@contextmanager
def gloo_failures(kind: str, timeout: datetime.timedelta) -> Iterator[None]:
    """A gloo transfer of operation ``kind`` that failed as one line: past ``timeout``
    :class:`~datastore.errors.ExchangeTimeout` (a peer stalled or failed), a connection closed
    :class:`~datastore.errors.PeerFailed` (a peer exited or was killed); other errors as
    they are."""
    try:
        yield
    except RuntimeError as exc:
        text = " ".join(str(exc).split())
        what = f"the trainer's {kind} over gloo"
        if gloo_timed_out(exc):
            raise ExchangeTimeout(
                f"{what} did not complete within comm_timeout ({timeout.total_seconds():g} s): "
                f"a peer rank stalled or failed ({text})",
                -1,
                (),
            ) from None
        if any(c in text for c in _CLOSED):
            raise PeerFailed(
                f"{what} lost its connection to a peer rank: it exited or failed ({text})"
            ) from None
        raise


def start_all_reduce(
    t: torch.Tensor, group: Any, timeout: datetime.timedelta, op: Any = dist.ReduceOp.SUM
) -> Pending:
    """Start reducing ``t`` in place over ``group``; the result is in ``t`` after ``wait()``."""
    nccl = backend_of(group) == "nccl"
    if is_staged(t, group):
        host = _host_copy(t, "all_reduce")
        work = dist.all_reduce(host, op=op, group=group, async_op=True)
        return Pending([work], False, timeout, [(host, t)], kind="all_reduce", device=t.device)
    work = dist.all_reduce(t, op=op, group=group, async_op=True)
    return Pending([work], nccl, timeout, kind="all_reduce", device=_cuda(t))


def all_reduce_sum(t: torch.Tensor, group: Any, timeout: datetime.timedelta) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place and return it; waits at most ``timeout``."""
    start_all_reduce(t, group, timeout).wait()
    return t


def all_gather(t: torch.Tensor, group: Any, timeout: datetime.timedelta) -> list[torch.Tensor]:
    """``t`` of every rank of ``group``, by group rank (equal shapes); waits at most ``timeout``."""
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    if is_staged(t, group):
        host = _host_copy(t, "all_gather")
        got = [_host_like(t) for _ in out]
        work = dist.all_gather(got, host, group=group, async_op=True)
        back = list(zip(got, out, strict=True))
        Pending([work], False, timeout, back, kind="all_gather", device=t.device).wait()
        return out
    work = dist.all_gather(out, t, group=group, async_op=True)
    nccl = backend_of(group) == "nccl"
    Pending([work], nccl, timeout, kind="all_gather", device=_cuda(t)).wait()
    return out


def broadcast(t: torch.Tensor, src: int, group: Any, timeout: datetime.timedelta) -> None:
    """Overwrite ``t`` with global rank ``src``'s ``t`` on every rank of ``group``."""
    if is_staged(t, group):
        host = _host_copy(t, "broadcast")
        work = dist.broadcast(host, src=src, group=group, async_op=True)
        Pending([work], False, timeout, [(host, t)], kind="broadcast", device=t.device).wait()
        return
    work = dist.broadcast(t, src=src, group=group, async_op=True)
    nccl = backend_of(group) == "nccl"
    Pending([work], nccl, timeout, kind="broadcast", device=_cuda(t)).wait()


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
        works = dist.batch_isend_irecv(ops)
        return Pending(works, True, timeout, keep=[t for _, t, _ in sends], device=sample.device)
    staged = is_staged(sample, group)
    works, back, keep = [], [], []
    with gloo_failures("exchange", timeout):  # a connection closed already fails the posting
        for peer, t, tag in recvs:
            buf = _host_like(t) if staged else t
            if staged:
                back.append((buf, t))
            works.append(dist.irecv(buf, group=group, group_src=peer, tag=tag))
        for peer, t, tag in sends:
            buf = _host_copy(t, "exchange") if staged else t
            keep.append(buf)
            works.append(dist.isend(buf, group=group, group_dst=peer, tag=tag))
    return Pending(works, False, timeout, back, keep, device=_cuda(sample))


def exchange(
    sends: Sequence[Message], recvs: Sequence[Message], group: Any, timeout: datetime.timedelta
) -> None:
    """:func:`start_exchange` and wait for it."""
    start_exchange(sends, recvs, group, timeout).wait()

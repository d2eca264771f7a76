"""The exchange over ``torch.distributed`` (gloo): the MPI exchange's messages under torchrun.

Without MPI (torchrun, or any launcher that only sets up ``torch.distributed``) the ranks still
hold the dataset once between them: the same ``plan()`` as the MPI exchange, as gloo
``isend``/``irecv`` of CPU tensors, over a gloo group of the loader's own. An owner sends the
part of each stored sample that a consumer's box covers: straight from the store when it is
contiguous there (whole samples), else packed into a staging array; the consumer receives it
straight into its place in the batch buffer when that is contiguous, else into a staging array
copied there after the wait, and writes the zero halo outside the volume itself (buffers are
reused). Staging arrays are kept from step to step. gloo matches messages between two ranks
in order, as MPI does, and every message of a step carries the step's tag.

Every wait has a deadline: gloo completes a point-to-point transfer only inside ``wait``
(``is_completed()`` stays false until then, so it cannot be polled), and ``wait`` takes a
timeout. A timeout names the step and the ranks still awaited, and leaves the exchange
unusable (that step's messages may still arrive).
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from datastore.errors import PeerFailed
from datastore.maths.delivery import Copy, covered, pad_copies
from datastore.maths.exchange import Message
from datastore.ranks.agree import default_store, gloo_timed_out, timeout_error
from datastore.sources.owners import ExchangeSetup, Owners, failure_report, peer_failed

__all__ = ["TorchExchange", "gloo_group", "keeps_group"]

_TAGS = 1 << 15  # message tags: the step modulo this
_CLOSE = _TAGS  # a receive nobody sends: its timed-out wait closes the group's connections


def gloo_group(group: Any = None) -> Any:
    """A private gloo group over the ranks of ``group`` (default: every rank), for one loader.

    The loader's collectives and messages run on its prefetch thread while the caller's own
    (DDP's all-reduces, metrics) run on the training thread: on one shared group they would
    interleave in a different order on different ranks, and ranks would wait in different
    collectives for ever (seen with a gloo default group). A group of its own keeps them
    apart, as ``comm.Dup()`` does for MPI, and is gloo whatever ``group``'s backend (NCCL
    takes no CPU tensors). Collective: every rank of ``group`` calls it, in the same order.
    The caller frees it with ``torch.distributed.destroy_process_group`` unless
    :func:`keeps_group` says to keep it.
    """
    if group is None:
        return dist.new_group(backend="gloo")
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)


def keeps_group(group: Any) -> bool:
    """Whether the gloo group :func:`gloo_group` made over ``group`` must outlive its loader.

    A group over given ranks is made with local synchronization, which torch names by a hash
    of its ranks and of the number of groups alive in the process: once destroyed, its name
    comes back with the next loader over the same ranks, whose rendezvous then meets the old
    group's keys in the store and hangs in ``new_group`` (for gloo's 30 minutes). So such a
    group is kept, with its connections, until the process ends; one over every rank
    (``group=None``) is named by a counter and freed."""
    return group is not None


class TorchExchange(Owners):
    """The MPI exchange's messages as gloo point-to-point calls within ``group``.

    Args:
        group: a gloo group of the exchange's own (:func:`gloo_group`), used by nobody
            else at the same time.
        setup: what the exchange moves (:class:`~datastore.sources.owners.ExchangeSetup`);
            ranks are the group's ranks.
    """

    kind = "torch.distributed"

    def __init__(self, group: Any, setup: ExchangeSetup) -> None:
        self.group = group
        super().__init__(dist.get_rank(group), setup)
        self._rooms = _Rooms()

    def _peer(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (what ``isend``/``irecv`` take)."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def step(self, step: int, msgs: list[Message], out: dict[str, np.ndarray]) -> None:
        """Deliver this rank's share of a step (its messages ``msgs``) into ``out`` (whole
        boxes, zero halo included); :class:`~datastore.errors.ExchangeTimeout` names the step
        and the peers if the messages do not arrive within the timeout."""
        self.usable()
        t0 = time.perf_counter()
        me = self.rank
        self._rooms.reset()
        works: list[tuple[Any, int]] = []
        unpack: list[Copy] = []  # received into a staging array: copied after the wait
        copies: list[Copy] = []  # zero halo and this rank's own samples: while messages travel
        sent: list[np.ndarray] = []
        # whatever fails once a message is posted (a timeout, a peer gone, a read error): gloo
        # may still write into this step's buffers, so the exchange takes no step after it
        with self.failing_at(step, tell=lambda exc: self._tell(step, exc)):
            # receives first, in plan order (gloo matches a pair's messages in order)
            for m in msgs:
                if m.dst == me and m.src != me:
                    for f in self.mine:
                        dst = out[f.name][m.pos, ...]
                        _, inner = covered(f)
                        place = dst[(*inner, ...)]
                        room = place
                        if not place.flags.c_contiguous:  # a block of a multi-axis box
                            room = self._rooms.take(place.shape, place.dtype)
                            unpack.append((place, room))
                        work = self._post(dist.irecv, _wire(room), m.src, step)
                        works.append((work, m.src))
                        copies.extend(pad_copies(f, dst))
            for m in msgs:
                if m.src == me and m.dst != me:
                    for f in self.setup.fields[m.block]:
                        src, _ = covered(f)
                        # lasting: gloo reads the array until the send completes, after this
                        # step's later gets (a re-read sample's scratch array is reused by them)
                        part = self.setup.store.lasting(m.sample, f.name)[(*src, ...)]
                        if not part.flags.c_contiguous:
                            packed = self._rooms.take(part.shape, part.dtype)
                            np.copyto(packed, part)
                            part = packed
                        sent.append(part)
                        work = self._post(dist.isend, _wire(part), m.dst, step)
                        works.append((work, m.dst))
                        self.bytes_sent += part.nbytes
            deadline = time.monotonic() + self.setup.timeout
            copies.extend(self.own_copies(msgs, out))
            self.setup.gather.run(copies)
            self._wait(works, step, deadline)
            self.setup.gather.run(unpack)
        self.seconds += time.perf_counter() - t0

    def _wait(self, works: list[tuple[Any, int]], step: int, deadline: float) -> None:
        """Wait for every message until ``deadline`` (gloo completes a point-to-point work only
        in ``wait``, which takes a timeout); name the ranks still awaited."""
        for i, (work, peer) in enumerate(works):
            left = max(0.001, deadline - time.monotonic())
            try:
                work.wait(timedelta(seconds=left))
            except RuntimeError as exc:
                if gloo_timed_out(exc):
                    peers = tuple(sorted({peer} | _pending(works[i + 1 :])))
                    raise timeout_error("the torch.distributed exchange", step, peers) from None
                raise self._lost(peer, step, exc) from None

    def _post(self, op: Any, buf: torch.Tensor, peer: int, step: int) -> Any:
        """``op`` (``dist.isend`` or ``dist.irecv``) of ``buf`` with group rank ``peer`` at
        ``step``; a connection that closed already is :meth:`_lost`."""
        try:
            return op(buf, self._peer(peer), group=self.group, tag=step % _TAGS)
        except RuntimeError as exc:
            raise self._lost(peer, step, exc) from None

    def _lost(self, peer: int, step: int, exc: RuntimeError) -> PeerFailed:
        """The error of ``step`` when its connection to ``peer`` closed: why the peer's step
        failed, if it said (at this step or an earlier one this rank had done with), else that
        it is gone."""
        told = self._told(peer)
        if told is not None:
            return peer_failed(peer, told, "the torch.distributed exchange")
        return PeerFailed(
            f"rank {peer} is gone: the torch.distributed exchange at step {step} lost its "
            f"connection ({' '.join(str(exc).split())}); it exited or failed"
        )

    def _key(self, rank: int) -> str:
        """The name of ``rank``'s report that a step failed: one at most, as the exchange takes
        no step after it (the group names the loader)."""
        return f"datastore/exchange/{self.group.group_name}/{rank}"

    def _tell(self, step: int, exc: BaseException) -> None:
        """Report why ``step`` failed here (not a timeout or a peer's failure, which the peers
        see themselves; not an interrupt), then close the group's connections, so that a peer
        blocked in this step's ``wait`` stops now: gloo closes them all when a wait times out,
        and has no other way to end a peer's wait."""
        report = failure_report(step, exc)
        if report is None:
            return
        store = default_store()
        if store is not None:
            with contextlib.suppress(RuntimeError):  # the store's host is gone
                store.set(self._key(self.rank), report)
        peer = self._peer((self.rank + 1) % dist.get_world_size(self.group))
        with contextlib.suppress(RuntimeError):  # closed already
            work = dist.irecv(torch.empty(1, dtype=torch.uint8), peer, group=self.group, tag=_CLOSE)
            work.wait(timedelta(milliseconds=1))

    def _told(self, peer: int) -> bytes | None:
        """``peer``'s report of its failed step, or ``None`` (it exited, or was killed)."""
        store, key = default_store(), self._key(peer)
        try:
            return store.get(key) if store and store.check([key]) else None
        except RuntimeError:  # the store's host is gone with it
            return None

    def close(self) -> None:
        """Frees the staging arrays; the group is the caller's (or shared by every loader)."""
        self._rooms = _Rooms()


def _pending(works: list[tuple[Any, int]]) -> set[int]:
    """The peers of ``works`` still incomplete after a last short wait each (gloo reports
    completion only from ``wait``); only after a timeout, to name the ranks awaited."""
    late = set()
    for work, peer in works:
        if peer in late:
            continue
        try:
            work.wait(timedelta(milliseconds=1))
        except RuntimeError:
            late.add(peer)
    return late


def _wire(a: np.ndarray) -> torch.Tensor:
    """The bytes of C-contiguous ``a`` as a uint8 tensor sharing its memory (any dtype, 0-d
    included: gloo moves bytes)."""
    return torch.from_numpy(a.reshape(-1).view(np.uint8))


class _Rooms:
    """Contiguous staging arrays for blocks that are not contiguous in the sample or in the
    batch buffer, reused from step to step (fresh large arrays would fault in new pages every
    step): at most one step's worth is kept."""

    def __init__(self) -> None:
        self._kept: dict[tuple, list[np.ndarray]] = {}
        self._used: dict[tuple, int] = {}

    def reset(self) -> None:
        """Every array is free again (the previous step has completed)."""
        self._used.clear()

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (shape, np.dtype(dtype).str)
        kept = self._kept.setdefault(key, [])
        n = self._used.get(key, 0)
        if n == len(kept):
            kept.append(np.empty(shape, dtype))
        self._used[key] = n + 1
        return kept[n]

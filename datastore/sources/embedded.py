"""The embedded sources: batches from a store of this process, read by this rank itself
(:class:`~datastore.sources.local.LocalSource`) or exchanged between the ranks that hold the
dataset once between them (:class:`ExchangeSource`), behind the interface of the service
source (``batches`` into the ring, ``counters``, ``close``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from datastore.maths.exchange import EpochPlan
from datastore.maths.order import RankLayout, Schedule
from datastore.ranks.agree import StepSync
from datastore.store.ring import Buffer, BufferRing
from datastore.store.store import Counters, Store

__all__ = ["EmbeddedSource", "ExchangeSource"]


class EmbeddedSource:
    """What the embedded sources share; a subclass delivers each step (:meth:`deliver`).

    Args:
        schedule: the sample sequence.
        store: the rank's samples; closed by :meth:`close`.
        sync: the ranks' agreement on where a pass starts and stops. Default: ``None`` (this
            rank alone).
    """

    session_id = None  # no service session
    kind: str  # "local", "mpi" or "torch.distributed"

    def __init__(self, schedule: Schedule, store: Store, sync: StepSync | None = None) -> None:
        self.schedule, self.store, self.sync = schedule, store, sync

    def deliver(self, epoch: int, step: int, out: dict[str, np.ndarray]) -> None:
        """Fill ``out`` with this rank's share of ``step`` of ``epoch``."""
        raise NotImplementedError

    @property
    def steps_together(self) -> bool:
        """The ranks step together, so a loader runs one pass at a time."""
        return self.sync is not None

    def batches(
        self, epoch: int, start: int, stop: threading.Event, ring: BufferRing
    ) -> Iterator[tuple[int, Buffer]]:
        """``(step, buffer)`` of ``epoch`` from ``start``, each step delivered into a buffer of
        ``ring``. With ``sync`` every rank starts at the same position and stops at the same
        step."""
        sync = self.sync
        if sync is not None:
            sync.start(epoch, start)
        for step in range(start, self.schedule.steps_per_epoch):
            if sync is not None:
                if sync.halt(step, stop.is_set()):
                    return
            elif stop.is_set():
                return
            buf = ring.take()
            try:
                self.deliver(epoch, step, buf.arrays)
            except BaseException:
                ring.give_back(buf)
                raise
            yield step, buf

    @property
    def counters(self) -> Counters:
        return Counters(**self.store.counters.as_dict())

    def close(self) -> None:
        self.store.close()


class ExchangeSource(EmbeddedSource):
    """The ranks hold the dataset once between them; ``exchange`` delivers every step, its
    messages planned an epoch at a time (:class:`EpochPlan`).

    Args:
        schedule: the sample sequence.
        layout: this rank's place in the data x spatial grid.
        owned: the samples this rank stores.
        exchange: an ``MpiExchange`` or ``TorchExchange`` (its store is this source's); closed
            by :meth:`close`.
        sync: the ranks' agreement on where a pass starts and stops.
    """

    def __init__(
        self,
        schedule: Schedule,
        layout: RankLayout,
        owned: np.ndarray,
        exchange: Any,
        sync: StepSync,
    ) -> None:
        super().__init__(schedule, exchange.setup.store, sync)
        self.layout, self.owned, self.exchange = layout, owned, exchange
        self.plan: EpochPlan | None = None

    @property
    def kind(self) -> str:
        """``"mpi"`` or ``"torch.distributed"``."""
        return self.exchange.kind

    def batches(
        self, epoch: int, start: int, stop: threading.Event, ring: BufferRing
    ) -> Iterator[tuple[int, Buffer]]:
        """As :meth:`EmbeddedSource.batches`; an exchange whose step failed refuses first,
        before the ranks' start check (so it sends nothing more)."""
        self.exchange.usable()
        yield from super().batches(epoch, start, stop, ring)

    def deliver(self, epoch: int, step: int, out: dict[str, np.ndarray]) -> None:
        if self.plan is None or self.plan.epoch != epoch:
            owner = self.exchange.setup.owner
            self.plan = EpochPlan(self.schedule, owner, self.layout, epoch, self.owned)
        self.exchange.step(step, self.plan.messages(step), out)

    @property
    def counters(self) -> Counters:
        c = super().counters
        c.bytes_exchanged, c.exchange_seconds = self.exchange.bytes_sent, self.exchange.seconds
        return c

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None
        super().close()

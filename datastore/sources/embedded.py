"""The embedded store as one source: this rank's own reads (local) or an exchange between
the ranks, behind the interface of the service source (``batches`` into the ring,
``counters``, ``close``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from datastore.agree import StepSync
from datastore.exchange import EpochPlan
from datastore.order import RankLayout, Schedule
from datastore.ring import Buffer, BufferRing
from datastore.sources.local import filled_batches
from datastore.store import Counters, Store

__all__ = ["EmbeddedSource", "Planned"]


class EmbeddedSource:
    """Batches from a store of this process.

    Args:
        schedule: the sample sequence.
        store: the rank's samples; closed by :meth:`close`.
        deliver: ``deliver(epoch, step, arrays)`` fills a batch's arrays.
        exchange: the exchange between the ranks (``MpiExchange``, ``TorchExchange``), closed
            by :meth:`close`; with it ``sync`` steps the ranks together. Default: ``None``
            (local reads).
        sync: the ranks' agreement on where a pass starts and stops. Default: ``None``.
    """

    session_id = None  # no service session

    def __init__(
        self,
        schedule: Schedule,
        store: Store,
        deliver: Any,
        exchange: Any = None,
        sync: StepSync | None = None,
    ) -> None:
        self.schedule, self.store, self._deliver = schedule, store, deliver
        self.exchange, self._sync = exchange, sync

    @property
    def kind(self) -> str:
        """``"local"``, ``"mpi"`` or ``"torch.distributed"``."""
        return self.exchange.kind if self.exchange is not None else "local"

    @property
    def steps_together(self) -> bool:
        """The ranks step together, so a loader runs one pass at a time."""
        return self._sync is not None

    def batches(
        self, epoch: int, start: int, stop: threading.Event, ring: BufferRing
    ) -> Iterator[tuple[int, Buffer]]:
        return filled_batches(self.schedule, epoch, start, stop, ring, self._deliver, self._sync)

    @property
    def counters(self) -> Counters:
        c = self.store.counters
        if self.exchange is not None:
            c.bytes_exchanged = self.exchange.bytes_sent
            c.exchange_seconds = self.exchange.seconds
        return c

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
            self.exchange = None
        self.store.close()


class Planned:
    """An exchange's deliveries, planned an epoch at a time (:class:`EpochPlan`)."""

    def __init__(
        self, schedule: Schedule, owner: Any, layout: RankLayout, owned: np.ndarray, ex: Any
    ) -> None:
        self.schedule, self.owner, self.layout, self.owned, self.ex = (
            schedule, owner, layout, owned, ex
        )  # fmt: skip
        self.plan: EpochPlan | None = None

    def __call__(self, epoch: int, step: int, out: dict[str, np.ndarray]) -> None:
        if self.plan is None or self.plan.epoch != epoch:
            self.plan = EpochPlan(self.schedule, self.owner, self.layout, epoch, self.owned)
        self.ex.step(step, self.plan.messages(step), out)

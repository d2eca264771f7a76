"""What the two exchanges share: the ranks' grid, the store of owned samples, the messages of a
step, and the copies of the samples a rank both owns and consumes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from datastore.errors import DataStoreError, ExchangeTimeout, PeerFailed
from datastore.maths.delivery import Copy, Delivered, box_copies
from datastore.maths.exchange import Message, rank_plan
from datastore.maths.ownership import RunOwners
from datastore.store.gather import Gather
from datastore.store.store import Store

__all__ = ["ExchangeSetup", "Owners", "failure_report", "peer_failed"]

_WHY_BYTES = 1024  # a failure report's most bytes


def failure_report(step: int, exc: BaseException) -> bytes | None:
    """What a rank whose ``step`` failed with ``exc`` tells that step's peers (``b"STEP why"``,
    bounded), or ``None``: a timeout or a peer's failure (the peers see those themselves), or
    an interrupt."""
    if isinstance(exc, ExchangeTimeout | PeerFailed) or not isinstance(exc, Exception):
        return None
    return f"{step} {type(exc).__name__}: {exc}".encode()[:_WHY_BYTES]


def peer_failed(peer: int, report: bytes, what: str) -> PeerFailed:
    """The error of a rank told by ``peer``'s :func:`failure_report` that its step failed, in
    ``what`` (``"the MPI exchange"``)."""
    step, why = report.decode(errors="replace").split(" ", 1)
    return PeerFailed(
        f"rank {peer} failed ({why}) at step {step} of {what}, whose messages this rank waited for"
    )


@dataclass(frozen=True)
class ExchangeSetup:
    """What an exchange moves, between which ranks, from where, whatever carries it (MPI or
    ``torch.distributed``).

    Args:
        owner: ``owner[sample]``, the rank that stores each sample: a
            :class:`~datastore.maths.ownership.RunOwners`: contiguous shares (O(ranks)) or a sharded
            dataset's runs of files (O(files)).
        data_world, spatial_size: the data x spatial grid (ranks spatial-fastest).
        store: this rank's store of the whole samples it owns.
        fields: ``{block: fields as that block receives them}``.
        gather: the batch copies.
        timeout: seconds a step may wait for its messages.
    """

    owner: RunOwners
    data_world: int
    spatial_size: int
    store: Store
    fields: dict[int, list[Delivered]]
    gather: Gather
    timeout: float


class Owners:
    """The state of an exchange over ``rank``'s view of the job.

    Args:
        rank: this rank in the exchange's communicator or group.
        setup: what the exchange moves (:class:`ExchangeSetup`).
    """

    def __init__(self, rank: int, setup: ExchangeSetup) -> None:
        self.rank, self.setup = rank, setup
        self.mine = setup.fields[rank % setup.spatial_size]  # what this rank receives
        self.bytes_sent = 0
        self.seconds = 0.0  # time spent in step()
        self.failed_at: int | None = None  # the step that timed out or failed: none after it

    def usable(self) -> None:
        """Raise if a step failed: that step's messages may still arrive, into its buffers or
        matched in place of a later step's, so the exchange takes no step after it (a new
        loader exchanges over a communicator or group of its own)."""
        if self.failed_at is not None:
            raise DataStoreError(
                f"the {self.kind} exchange failed at step {self.failed_at} and cannot be used "
                "again (messages of that step may still arrive): make a new loader"
            )

    @contextmanager
    def failing_at(
        self,
        step: int,
        abandon: Callable[[], None] = lambda: None,
        tell: Callable[[BaseException], None] = lambda exc: None,
    ) -> Iterator[None]:
        """Around a step from its first posted message: whatever escapes (a timeout, a peer
        gone, a read error, an interrupt) runs ``abandon`` (keep what a transfer may still
        touch) and ``tell`` (the exception: say it to the peers), and marks the exchange failed
        at ``step``, so that :meth:`usable` refuses the next step whose buffers those messages
        could still reach."""
        try:
            yield
        except BaseException as exc:
            abandon()
            self.failed_at = step
            tell(exc)
            raise

    def messages(self, batch: np.ndarray) -> list[Message]:
        """The messages this rank sends or receives at the step of global ``batch``."""
        s = self.setup
        return rank_plan(batch, s.owner, s.data_world, s.spatial_size, self.rank)

    def own_copies(self, msgs: list[Message], out: dict[str, np.ndarray]) -> list[Copy]:
        """The copies of the samples this rank owns and consumes itself, into ``out``."""
        copies: list[Copy] = []
        for m in msgs:
            if m.src == self.rank and m.dst == self.rank:
                for f in self.mine:
                    vol = self.setup.store.lasting(m.sample, f.name)
                    copies.extend(box_copies(f, out[f.name][m.pos, ...], vol))
        return copies

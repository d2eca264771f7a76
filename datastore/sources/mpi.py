"""The MPI exchange: owners send each consumer exactly the blocks it needs, every step.

Every rank owns a share of the samples (``owner[sample]``), read once into its store. The
messages of a step are a pure function of the global batch (``datastore.maths.exchange.plan``), so
sender and receiver agree on every message without talking about it.

Messages are non-blocking point-to-point calls (buffer-based, no pickles) of contiguous bytes
(:class:`~datastore.ranks.subarrays.BoxMessages`): a block's part inside the volume is sent
straight from the stored sample as its contiguous runs (a part of short runs, such as a block
cut on the last axis, packed into one message), and received straight into its place in the
batch buffer where that place is contiguous, else (a block amid its halo) into a reused buffer
aside, copied in once the step's messages are in. MPI subarray datatypes would spare those
copies, but with mpich 5 a block amid its halo moved at 0.01 GB/s that way. The zero halo
outside the volume is written by the receiver, since buffers are reused and consumers may edit
them. Waits are polled, so a peer that never sends stops the step with an error naming it
instead of a hang; that step's buffers are then kept until the process exits, since the peer
may yet send and MPI move the bytes, even in ``MPI_Finalize``, and the exchange takes no
step after it (:meth:`~datastore.sources.owners.Owners.usable`). A rank whose step fails (a
sample it owns cannot be read) tells that step's peers why, so that they raise
:class:`~datastore.errors.PeerFailed` with its error at once instead of waiting out the timeout.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from datastore.maths.delivery import Delivered, covered, pad_copies
from datastore.maths.exchange import Message
from datastore.ranks.agree import poll
from datastore.ranks.subarrays import BoxMessages
from datastore.sources.owners import ExchangeSetup, Owners, failure_report, peer_failed

__all__ = ["MpiExchange"]

_FAILED = 1  # a rank's report that its step failed (the steps' messages are tag 0)


class MpiExchange(Owners):
    """Non-blocking sends and receives per step over a private duplicate of ``comm``.

    Args:
        comm: the job's mpi4py communicator (duplicated: our messages never mix with yours).
        setup: what the exchange moves (:class:`~datastore.sources.owners.ExchangeSetup`).
    """

    kind = "mpi"

    def __init__(self, comm: Any, setup: ExchangeSetup) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm.Dup()
        super().__init__(self.comm.Get_rank(), setup)
        self._boxes = BoxMessages(self.comm)
        self._reports: list[Any] = []  # what this rank told its peers: kept, as the sends

    def step(
        self,
        step: int,
        msgs: list[Message],
        out: dict[str, np.ndarray],
    ) -> None:
        """Deliver this rank's share of a step (its messages ``msgs``) into ``out`` (whole
        boxes, zero halo included); :class:`~datastore.errors.ExchangeTimeout` names the step
        and the peers if the messages do not arrive within the timeout."""
        self.usable()
        t0 = time.perf_counter()
        me = self.rank
        requests: list[Any] = []
        peers: list[int] = []
        copies = []

        def pending() -> list[int]:
            return sorted({p for r, p in zip(requests, peers, strict=True) if not r.Test()})

        # whatever fails once a message is posted: its bytes may still move, up to MPI_Finalize,
        # so this round's buffers are kept till exit
        with self.failing_at(
            step, lambda: self._boxes.abandon(requests), lambda exc: self._tell(step, msgs, exc)
        ):
            # receives first, in plan order (MPI matches same-pair messages in order)
            for m in msgs:
                if m.dst == me and m.src != me:
                    for f in self.mine:
                        dst = out[f.name][m.pos, ...]
                        src, inner = covered(f)
                        sent = self._boxes.recv(dst, inner, (_sample_shape(f), src), m.src)
                        requests += sent
                        peers += [m.src] * len(sent)
                        copies.extend(pad_copies(f, dst))
            for m in msgs:
                if m.src == me and m.dst != me:
                    for f in self.setup.fields[m.block]:
                        vol = self.setup.store.lasting(m.sample, f.name)  # it must outlive the send
                        src, _ = covered(f)
                        sends = self._boxes.send(vol, src, m.dst)
                        requests += sends
                        peers += [m.dst] * len(sends)
                        self.bytes_sent += f.nbytes
            copies.extend(self.own_copies(msgs, out))
            self.setup.gather.run(copies)
            poll(
                lambda: self._mpi.Request.Testall(requests) or self._told(),
                deadline=time.monotonic() + self.setup.timeout,
                what="the MPI exchange",
                step=step,
                pending=pending,
            )
            self.setup.gather.run(self._boxes.unpacks())
        self._boxes.release()
        self.seconds += time.perf_counter() - t0

    def _tell(self, step: int, msgs: list[Message], exc: BaseException) -> None:
        """Tell the peers of ``step`` (those it sends to or receives from) that it failed
        here, and why (:func:`~datastore.sources.owners.failure_report`): they may wait for its
        messages in vain."""
        report = failure_report(step, exc)
        if report is None:
            return
        why = bytearray(report)
        for peer in sorted(({m.src for m in msgs} | {m.dst for m in msgs}) - {self.rank}):
            self._reports.append((why, self.comm.Isend([why, self._mpi.BYTE], peer, _FAILED)))

    def _told(self) -> bool:
        """``False``, or raise :class:`PeerFailed` if a peer told that its step failed."""
        status = self._mpi.Status()
        if not self.comm.Iprobe(self._mpi.ANY_SOURCE, _FAILED, status):
            return False
        report = bytearray(status.Get_count(self._mpi.BYTE))
        self.comm.Recv([report, self._mpi.BYTE], status.Get_source(), _FAILED)
        raise peer_failed(status.Get_source(), bytes(report), "the MPI exchange")

    def close(self) -> None:
        self.comm.Free()


def _sample_shape(f: Delivered) -> tuple[int, ...]:
    """The shape of the stored sample ``f``'s part is sent from."""
    return f.sample_shape if f.blocked else f.shape

"""Collective checks with a deadline: every rank learns the same thing, or times out clearly.

Multi-rank code must refuse on every rank alike: a rank that raises alone leaves its peers
waiting in the next collective. So a loader checks its arguments locally, then *all* ranks
exchange what they found (:func:`agree`) and raise the same error together: one rank's bad
argument, or ranks that disagree (``seed=rank``), becomes one error on every rank.

The collectives are non-blocking and polled against a deadline, so a rank that never arrives
gives an :class:`~datastore.errors.ExchangeTimeout` naming it instead of a hang. The check of
every step (:meth:`StepSync.halt`) is one reduction (MPI's ``Iallreduce``: O(log P) messages
per rank); only when it shows ranks that differ, or times out, do the ranks exchange messages
with every other rank to name the ones at fault.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import os
import pickle
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import numpy as np

from datastore.errors import ExchangeTimeout, PeerFailed, RankMismatch

__all__ = [
    "Collective",
    "StepSync",
    "StoreCollective",
    "agree",
    "default_store",
    "gloo_timed_out",
    "poll",
    "timeout_error",
]


def poll(
    done: Any,
    *,
    deadline: float,
    what: str = "a collective",
    step: int = -1,
    pending: Any = None,
    spin: float = 0.0,
) -> None:
    """Wait until ``done()`` is true; past ``deadline`` raise :class:`ExchangeTimeout` naming
    ``what``, ``step`` and the ranks ``pending()`` still awaits. For the first ``spin``
    seconds ``done()`` is asked again at once (yielding the core only to a process that wants
    it), then after ever longer naps."""
    spins = 0
    spin_until = time.monotonic() + spin
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise timeout_error(what, step, tuple(pending()) if pending is not None else ())
        if now < spin_until:
            os.sched_yield()
            continue
        spins += 1
        if spins > 100:  # past a short spin, yield the core to the threads doing the work
            time.sleep(0.0005 if spins < 2000 else 0.005)
    return True


def timeout_error(what: str, step: int, peers: tuple[int, ...]) -> ExchangeTimeout:
    """The error of a wait that outlasted the timeout."""
    who = f" (waiting for rank {', '.join(map(str, peers))})" if peers else ""
    at = f" at step {step}" if step >= 0 else ""
    return ExchangeTimeout(
        f"{what}{at} did not complete within the timeout{who}: a peer rank may have failed, "
        "or stopped iterating while this one went on",
        step,
        peers,
    )


def gloo_timed_out(exc: BaseException) -> bool:
    """Whether a gloo wait failed at its timeout (gloo raises ``RuntimeError`` for every
    failure, and says which only in its text); any other failure is a connection lost."""
    return "Timed out" in str(exc)


_TAG = 1 << 20  # the checks' messages; the torch exchange tags its steps below 32768
_WHY_TAG = _TAG + 1  # a stopped rank's report that it failed or exited (MPI)
_WHY_BYTES = 1024  # a report's most bytes
_HERE_TAG = _TAG + 2  # after a reduction timed out: "this rank is in it" (MPI)
# Seconds a rank waiting for a reduction asks again without a nap (yielding its core to any
# process that wants it): a round needs its partner to run, and a nap per round made a check
# on 2 ranks about 1 ms and on 3-8 ranks sharing 2 cores 2-4 ms (now 0.01-0.1 ms).
_SPIN = 0.005


class Collective:
    """The few collectives the loader needs, over an mpi4py communicator (duplicated: its
    messages never mix with the caller's) or a ``torch.distributed`` group (gloo), each with a
    deadline.

    :meth:`allgather_ints` sends point-to-point messages to every other rank rather than one
    ``allgather``: a rank whose message does not come is then known, and a timeout names it;
    2 (P - 1) messages of a few bytes per rank, so it serves start-up checks and diagnoses.
    :meth:`allreduce_max` serves the checks of every step: over MPI one ``Iallreduce``
    (recursive doubling for a few bytes in MPICH and Open MPI: about 2 log2 P messages per
    rank), whose timeout is followed by a diagnosis round that names the absent ranks.
    """

    def __init__(self, comm: Any = None, group: Any = None) -> None:
        self.comm, self.group = (comm.Dup() if comm is not None else None), group
        if comm is not None:
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        else:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def allgather_ints(
        self, values: list[int], timeout: float, what: str, step: int = -1
    ) -> np.ndarray:
        """``(size, len(values))`` int64: every rank's ``values``. Past ``timeout`` seconds an
        :class:`ExchangeTimeout` names ``what``, ``step`` and the ranks that did not send."""
        mine = np.asarray(values, dtype=np.int64)
        out = np.empty((self.size, len(mine)), dtype=np.int64)
        out[self.rank] = mine
        peers = [r for r in range(self.size) if r != self.rank]
        deadline = time.monotonic() + timeout
        if self.comm is not None:
            recvs = [self.comm.Irecv(out[r], source=r, tag=_TAG) for r in peers]
            sends = [self.comm.Isend(mine, dest=r, tag=_TAG) for r in peers]
            from mpi4py import MPI

            def missing() -> list[int]:
                return [r for r, q in zip(peers, recvs, strict=True) if not q.Test()]

            try:
                poll(
                    lambda: MPI.Request.Testall(recvs + sends),
                    deadline=deadline,
                    what=what,
                    step=step,
                    pending=missing,
                )
            except ExchangeTimeout:
                for q in recvs:
                    q.Cancel()
                raise
            return out
        import torch
        import torch.distributed as dist

        rooms = {r: torch.empty(len(mine), dtype=torch.int64) for r in peers}
        theirs = {r: dist.get_global_rank(self.group, r) for r in peers}
        works = [(dist.irecv(rooms[r], theirs[r], group=self.group, tag=_TAG), r) for r in peers]
        mine_t = torch.from_numpy(mine)
        sends = [dist.isend(mine_t, theirs[r], group=self.group, tag=_TAG) for r in peers]
        for k, (work, _) in enumerate(works):
            try:  # gloo completes a point-to-point work only inside wait
                work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError as exc:
                if gloo_timed_out(exc):
                    raise timeout_error(what, step, tuple(r for _, r in works[k:])) from None
                at = f" at step {step}" if step >= 0 else ""
                raise PeerFailed(
                    f"rank {works[k][1]} is gone: {what}{at} lost its connection "
                    f"({' '.join(str(exc).split())}); it exited or failed"
                ) from None
        for work in sends:
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        for r in peers:
            out[r] = rooms[r].numpy()
        return out

    def allreduce_max(
        self, values: list[int], timeout: float, what: str, step: int = -1
    ) -> np.ndarray:
        """The elementwise maximum of every rank's ``values`` (int64; as many on every rank).

        Over MPI one non-blocking reduction, polled against ``timeout``; past it, each rank
        that was in it tells every other rank so for :func:`diagnosis` seconds, and the
        :class:`ExchangeTimeout` names the ranks not heard from. (An MPI reduction cannot be
        cancelled: after a timeout this collective is not to be used again.) Over
        ``torch.distributed``: the maximum of :meth:`allgather_ints`.
        """
        if self.comm is None:
            return self.allgather_ints(values, timeout, what, step).max(axis=0)
        from mpi4py import MPI

        mine = np.asarray(values, dtype=np.int64)
        out = np.empty_like(mine)
        request = self.comm.Iallreduce(mine, out, op=MPI.MAX)
        try:  # MPI moves a reduction's rounds on only inside calls: ask often at first
            poll(request.Test, deadline=time.monotonic() + timeout, what=what, step=step,
                 spin=_SPIN)  # fmt: skip
        except ExchangeTimeout:
            raise timeout_error(what, step, self._absent(diagnosis(timeout))) from None
        return out

    def _absent(self, wait: float) -> tuple[int, ...]:
        """The ranks that do not say within ``wait`` seconds that they are here (MPI); each
        rank in a reduction that timed out says so to every other."""
        peers = [r for r in range(self.size) if r != self.rank]
        rooms = np.zeros(len(peers), dtype=np.int64)
        recvs = [self.comm.Irecv(rooms[k : k + 1], source=r, tag=_HERE_TAG)
                 for k, r in enumerate(peers)]  # fmt: skip
        here = np.ones(1, dtype=np.int64)
        sends = [self.comm.Isend(here, dest=r, tag=_HERE_TAG) for r in peers]
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not all(q.Test() for q in recvs):
            time.sleep(0.005)
        absent = tuple(r for r, q in zip(peers, recvs, strict=True) if not q.Test())
        for r, q in zip(peers, recvs, strict=True):
            if r in absent:
                q.Cancel()
                q.Wait()
        for q in sends:
            q.Test()
        return absent

    def close(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (only after :meth:`allgather_ints` showed all ranks are here)."""
        if self.comm is not None:
            return self.comm.allgather(obj)
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # Rooted at rank 0, and like allgather only once allgather_ints showed all ranks are here.
    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0; ``None`` elsewhere."""
        if self.comm is not None:
            return self.comm.gather(obj, root=0)
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def bcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.comm is not None:
            return self.comm.bcast(obj, root=0)
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def scatter(self, objs: list[Any] | None) -> Any:
        """``objs[r]`` (given on rank 0) on each rank ``r``."""
        if self.comm is not None:
            return self.comm.scatter(objs, root=0)
        import torch.distributed as dist

        box: list[Any] = [None]
        src = dist.get_global_rank(self.group, 0)
        dist.scatter_object_list(box, objs if self.rank == 0 else None, src=src, group=self.group)
        return box[0]


class StoreCollective:
    """``allgather_ints`` and ``allgather`` over torchrun's rendezvous store, for the checks of
    ranks that have no process group yet (a loader made before ``init_process_group``).

    torchrun's agent hosts a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` from the start
    (``TORCHELASTIC_USE_AGENT_STORE=True``); each rank joins it as a client. Keys live under
    ``datastore/<run id>/<restart>/<loader>/<round>/<rank>``: the loaders of a process are
    numbered in the order they are made, the same on every rank, as collectives need anyway.

    Args:
        rank, size: this rank and the world size (torchrun's ``RANK``, ``WORLD_SIZE``).
        env: torchrun's environment.
    """

    _made = itertools.count()

    def __init__(self, rank: int, size: int, env: Mapping[str, str]) -> None:
        import torch.distributed as dist

        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        try:
            store = dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=60),
                wait_for_workers=False,
            )  # fmt: skip
        except (RuntimeError, ValueError) as exc:
            raise ValueError(
                f"torchrun's store at {host}:{port} (MASTER_ADDR, MASTER_PORT) cannot be "
                f"reached to check that the ranks agree: {exc}"
            ) from None
        run = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.store = dist.PrefixStore(f"datastore/{run}/{next(self._made)}/", store)
        self.rank, self.size, self.rounds = rank, size, itertools.count()
        self.comm = self.group = None
        self.timeout = 60.0  # of the last allgather_ints, for allgather

    @classmethod
    def of(cls, rank: int, size: int, env: Mapping[str, str]) -> StoreCollective | None:
        """One for torchrun's rank ``rank`` of ``size`` when its agent's store is there."""
        from staging.cluster import torchrun_world

        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        where = ("MASTER_ADDR", "MASTER_PORT")
        if not agent or torchrun_world(env) != (rank, size) or not all(k in env for k in where):
            return None
        return cls(rank, size, env)

    def _everyone(self, payload: bytes, timeout: float, what: str, step: int) -> list[bytes]:
        base = f"{next(self.rounds)}/"
        self.store.set(f"{base}{self.rank}", payload)
        keys = [f"{base}{r}" for r in range(self.size)]
        try:
            self.store.wait(keys, timedelta(seconds=timeout))
        except RuntimeError:  # torch's DistStoreError: the deadline passed
            missing = tuple(r for r, k in enumerate(keys) if not self.store.check([k]))
            raise timeout_error(what, step, missing) from None
        return [self.store.get(k) for k in keys]

    def allgather_ints(
        self, values: list[int], timeout: float, what: str, step: int = -1
    ) -> np.ndarray:
        """As :meth:`Collective.allgather_ints`."""
        mine = np.asarray(values, dtype=np.int64)
        self.timeout = timeout
        got = self._everyone(mine.tobytes(), timeout, what, step)
        return np.stack([np.frombuffer(b, dtype=np.int64) for b in got])

    def allreduce_max(
        self, values: list[int], timeout: float, what: str, step: int = -1
    ) -> np.ndarray:
        """As :meth:`Collective.allreduce_max`: the maximum of :meth:`allgather_ints`."""
        return self.allgather_ints(values, timeout, what, step).max(axis=0)

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, pickled through the store (only after :meth:`allgather_ints`
        showed all ranks are here)."""
        return [
            pickle.loads(b) for b in self._everyone(pickle.dumps(obj), self.timeout, "a check", -1)
        ]

    def close(self) -> None:
        self.store = None


def _digest(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little") >> 1


def agree(
    coll: Collective,
    fingerprint: dict[str, str],
    error: BaseException | None,
    timeout: float,
    what: str = "the loader's start-up check",
    doing: str | None = None,
) -> None:
    """Raise the same error on every rank when any rank had ``error`` or the ranks'
    ``fingerprint`` values differ (:class:`RankMismatch`, naming the key and the ranks). With
    ``doing`` a peer's error is a :class:`PeerFailed` (``rank R failed (Kind: text) <doing>``).

    ``fingerprint`` must have the same keys, in the same order, on every rank.
    """
    keys = list(fingerprint)
    got = coll.allgather_ints(
        [int(error is not None), *(_digest(fingerprint[k]) for k in keys)], timeout, what
    )
    if not got[:, 0].any() and (got[:, 1:] == got[0, 1:]).all():
        return
    every = coll.allgather((None if error is None else _describe(error), fingerprint))
    failed = [(r, e) for r, (e, _) in enumerate(every) if e is not None]
    if failed:
        if error is not None:
            raise error
        r, (kind, text) = failed[0]
        if doing is not None:
            raise PeerFailed(f"rank {r} failed ({kind}: {text}) {doing}")
        raise _rebuild(kind, f"rank {r} refused: {text}")
    for k in keys:
        values = [fp[k] for _, fp in every]
        if len(set(values)) > 1:
            groups: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            shown = "; ".join(f"ranks {_ranks(rs)}: {v}" for v, rs in groups.items())
            raise RankMismatch(
                f"ranks disagree on {k}: {shown}. Every rank of a job must pass the same {k}"
            )


def _describe(error: BaseException) -> tuple[str, str]:
    return type(error).__name__, str(error)


def _rebuild(kind: str, text: str) -> BaseException:
    """An error like a peer's: a ``ValueError`` stays a ``ValueError``, and so on."""
    import datastore.errors as errors

    cls = getattr(errors, kind, None) or {
        "ValueError": ValueError,
        "TypeError": TypeError,
        "FileNotFoundError": FileNotFoundError,
        "PermissionError": PermissionError,
        "MemoryError": MemoryError,
    }.get(kind, RuntimeError)
    return cls(text)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def diagnosis(timeout: float) -> float:
    """Seconds the ranks of a reduction that timed out listen for each other: the ranks in it
    time out within their skew of arriving; one not heard from within this is named."""
    return min(timeout / 2, 5.0)


def grace(timeout: float) -> float:
    """Seconds a rank that went on waits to hear why a peer stopped: a peer whose exception
    ends its process reports it this soon (``sys.excepthook``), one that broke its loop never."""
    return min(1.0, timeout / 4)


class StepSync:
    """Keeps the ranks of an exchange in step: the same position when an iteration starts,
    and every rank stopping at the same step when any consumer stops early.

    A rank that stops while its peers go on may be failing: its consumer's exception closes
    the pass before the exception ends the process. So the peers wait ``grace`` for a report
    (``_Ends``: sent from ``sys.excepthook`` or at exit) and say that the peer failed, with its
    error (``PeerFailed``), or else that it stopped iterating, and exited if it did
    (``RankMismatch``: a loop that ended early, or ``sys.exit`` in it, is a loop that differs).

    Args:
        coll: the ranks' collective.
        timeout: seconds to wait for the other ranks at each check.
    """

    _made = itertools.count()  # the same number on every rank: loaders are made in one order
    START, HALT = 1, 2  # which check a reduction is, first in it: ranks at different ones differ

    def __init__(self, coll: Collective, timeout: float) -> None:
        self.coll, self.timeout, self.number = coll, timeout, next(self._made)
        self.epoch = 0  # of the pass under way, in the reports' keys

    def start(self, epoch: int, step: int) -> None:
        """Raise :class:`RankMismatch` on every rank unless all start at ``(epoch, step)``."""
        ENDS.went_on(self)
        self.epoch = epoch
        what = f"the start of epoch {epoch}"
        top = self._check(self.START, [epoch, step, -epoch, -step], what, step)
        if top[0] == -top[2] and top[1] == -top[3]:  # max == min: all at (epoch, step)
            return
        got = self.coll.allgather_ints([epoch, step], self.timeout, what, step)  # where is each
        at = ", ".join(f"rank {r} at epoch {e} step {s}" for r, (e, s) in enumerate(got.tolist()))
        raise RankMismatch(
            f"ranks start iterating at different positions ({at}): every rank must iterate "
            "the loader alike (did one rank stop early, or call set_epoch alone?)"
        )

    def halt(self, step: int, stop: bool) -> bool:
        """Whether to stop before ``step``: when any rank's consumer stopped. A rank that went
        on while another stopped gets :class:`PeerFailed` when the other reports that it
        failed, else :class:`RankMismatch` naming it (not a short epoch).

        One reduction, ``[any stopped, any went on]``; only when some ranks stopped and some
        went on do they all learn which (:meth:`Collective.allgather_ints`)."""
        some_stopped, some_went_on = self._check(
            self.HALT, [int(stop), 1 - int(stop), 0, 0], "the step check", step
        )[:2]
        if not some_stopped:
            return False
        if not some_went_on:
            return True
        got = self.coll.allgather_ints([int(stop)], self.timeout, "the step check", step)
        stopped = np.flatnonzero(got[:, 0]).tolist()
        if stop:  # peers went on: tell them if this process ends
            ENDS.stopped(self, step, [r for r in range(len(got)) if r not in stopped])
            return True
        rank, why = self._why(step, stopped) or (None, None)
        if why is not None and why != "exited":
            raise PeerFailed(
                f"rank {rank} {why} before step {step} while this rank went on; its end "
                "ends the job's pass"
            )
        then = f", and then rank {rank} exited" if why == "exited" else ""
        raise RankMismatch(
            f"rank {_ranks(stopped)} stopped iterating before step {step} while this rank "
            f"went on{then}: every rank must take the same batches (stop on every rank at the "
            "same step)"
        )

    def _check(self, kind: int, values: list[int], what: str, step: int) -> np.ndarray:
        """The ranks' maximum of ``values`` (four ints: every check's reduction is as long),
        reduced with ``kind``, the check's number. Raises :class:`RankMismatch` when ranks
        are at different checks (one starting a pass, another at a step)."""
        got = self.coll.allreduce_max([kind, -kind, *values], self.timeout, what, step)
        if got[0] != -got[1]:
            raise RankMismatch(
                f"ranks are at different checks: this rank at {what} (step {step}), another "
                "not; every rank must iterate the loader alike"
            )
        return got[2:]

    # -- why a peer stopped ----------------------------------------------------------------------
    def _key(self, step: int, rank: int) -> str:
        """The name of ``rank``'s report of its end at ``step`` (a report names its pass)."""
        return f"datastore/ends/{self.number}/{self.epoch}/{step}/{rank}"

    def _why(self, step: int, stopped: list[int]) -> tuple[int, str] | None:
        """``(rank, "failed (ValueError: ...)" or "exited")`` of a stopped peer that reported
        its end within ``grace``, else ``None``."""
        deadline = time.monotonic() + grace(self.timeout)
        if self.coll.comm is not None:
            rooms = {r: np.zeros(_WHY_BYTES, np.uint8) for r in stopped}
            recvs = {r: self.coll.comm.Irecv(rooms[r], source=r, tag=_WHY_TAG) for r in stopped}
            try:
                while time.monotonic() < deadline:
                    for r, q in recvs.items():
                        if q.Test():
                            raw = rooms[r].tobytes().rstrip(b"\0").decode("utf-8", "replace")
                            key, _, why = raw.partition("\n")
                            if key == self._key(step, r):
                                return r, why
                            recvs[r] = self.coll.comm.Irecv(rooms[r], source=r, tag=_WHY_TAG)
                    time.sleep(0.005)
            finally:
                for q in recvs.values():
                    if not q.Test():
                        q.Cancel()
                        q.Wait()
            return None
        store = default_store()
        if store is None:
            return None
        keys = {r: self._key(step, r) for r in stopped}
        try:
            while time.monotonic() < deadline:
                for r, key in keys.items():
                    if store.check([key]):
                        return r, store.get(key).decode("utf-8", "replace")
                time.sleep(0.01)
        except RuntimeError:  # the store's host ended (rank 0 hosts it without torchrun)
            return stopped[0], "exited"
        return None

    def tell(self, step: int, went_on: list[int], why: str) -> None:
        """Report ``why`` this process ends to the ranks that went on after it stopped."""
        raw = why.encode("utf-8")[: _WHY_BYTES // 2]
        if self.coll.comm is not None:  # the report names its pass: a late one is told apart
            raw = f"{self._key(step, self.coll.rank)}\n".encode() + raw
            msg = np.zeros(_WHY_BYTES, np.uint8)
            msg[: len(raw)] = np.frombuffer(raw, np.uint8)
            sends = [self.coll.comm.Isend(msg, dest=r, tag=_WHY_TAG) for r in went_on]
            deadline = time.monotonic() + grace(self.timeout)
            while not all(q.Test() for q in sends) and time.monotonic() < deadline:
                time.sleep(0.005)
            return
        store = default_store()
        if store is not None:
            store.set(self._key(step, self.coll.rank), raw)


def default_store() -> Any:
    """The store of ``torch.distributed``'s default group (``None``: none, or not reachable)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # a private function: may move
        return None


class _Ends:
    """How this process ends, told to the peers that went on after it stopped mid-pass: an
    uncaught exception (``sys.excepthook``) as ``failed (Type: message)``, an exit as
    ``exited``. Told only within a grace of the stop, when the peers still listen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: dict[int, tuple[StepSync, int, list[int], float]] = {}
        self.hooked = False

    def stopped(self, sync: StepSync, step: int, went_on: list[int]) -> None:
        with self.lock:
            self.pending[sync.number] = (sync, step, went_on, time.monotonic())
            if not self.hooked:
                self.hooked = True
                previous = sys.excepthook

                def hook(kind: type, value: BaseException, tb: Any) -> None:
                    self.tell(f"failed ({kind.__name__}: {value})")
                    previous(kind, value, tb)

                sys.excepthook = hook
                atexit.register(self.tell, "exited")

    def went_on(self, sync: StepSync) -> None:
        """``sync``'s rank started a new pass: it did not end at its stop."""
        with self.lock:
            self.pending.pop(sync.number, None)

    def tell(self, why: str) -> None:
        with self.lock:
            pending, self.pending = list(self.pending.values()), {}
        for sync, step, went_on, at in pending:
            if time.monotonic() - at < 2 * grace(sync.timeout):
                with contextlib.suppress(Exception):  # a report never masks the real error
                    sync.tell(step, went_on, why)


ENDS = _Ends()

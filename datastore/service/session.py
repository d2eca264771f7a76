"""Sessions of ``datastore serve``: what fixes one job's batches, and the streams serving them.

A session is one job on one dataset: seed, global batch, world size and spatial layout fix the
sample sequence (``datastore.maths.order.Schedule``, the embedded loader's), and every rank streams
its share, filled from the dataset's resident copy (``datastore.service.resident``), which all
sessions on that dataset share. A session lives until ``CloseSession``, or until it has had no
stream for ``idle_s`` (its client died or forgot to close it): then it is closed and the dataset
it held is free to be evicted. A session whose ``OpenSession`` named a client process on this
node (``ClientProcess``) also ends as soon as that process does, however it ends
(:mod:`datastore.service.watch`): its streams stop and its shared-memory rings are freed at once.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from datastore.maths.delivery import chosen_fields
from datastore.maths.order import Schedule
from datastore.maths.rank_view import RankView, rank_view
from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.errors import ServiceError
from datastore.service.paths import shown
from datastore.service.peer_link import node_path
from datastore.service.resident import Fetching, Residency, Resident, resolve_dataset
from datastore.service.stream import SlotRing, Stream
from datastore.service.watch import ProcessWatch
from datastore.store.gather import Gather

__all__ = ["MAX_GLOBAL_BATCH", "MAX_WORLD", "Session", "Sessions", "job_of", "spatial_of"]

MAX_GLOBAL_BATCH = 1_000_000
MAX_WORLD = 1_000_000
MAX_PREFETCH = 64
FETCH_AHEAD = 4  # batches of a sharded dataset being fetched at once, at most


def spatial_of(layout: Any) -> dict[str, Any] | None:
    """A ``SpatialLayout`` message as ``{"parts", "halo", "boundary"}``; ``None``: no split."""
    if not layout.parts:
        return None
    out: dict[str, Any] = {"parts": tuple(layout.parts)}
    if layout.halo:
        out["halo"] = tuple(layout.halo)
    if layout.boundary:
        out["boundary"] = layout.boundary
    return out


def job_of(r: Any) -> str:
    """The job an ``OpenSessionRequest`` belongs to, the same for each of its ranks' sessions
    on every node: its job id, dataset (as clients name it), world, global batch and seed."""
    return json.dumps([r.job_id, r.dataset_path, r.world_size or 1, r.global_batch, r.seed])


@dataclass
class Session:
    """One open session."""

    session_id: str
    request: Any  # the OpenSessionRequest
    resident: Resident
    view: RankView  # rank 0's; :meth:`RankView.of_rank` gives the others'
    info: dict[str, Any]  # {field: FieldInfo} delivered
    spatial: dict[str, Any] | None
    opened_unix_s: float = field(default_factory=time.time)
    batches_served: int = 0
    bytes_served: int = 0
    stall_s: float = 0.0
    streams: set[Stream] = field(default_factory=set)
    rings: dict[tuple[int, bool], SlotRing] = field(default_factory=dict)
    last_active: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    gather: Gather | None = None  # the service's batch copies
    residency: Any = None  # counts the rings (shared memory or inline) in the memory budget
    inline_told: bool = False  # the log said its ring did not fit: streamed inline
    failed: str = ""  # why its job failed ("": it did not): its streams end ABORTED saying so

    @property
    def schedule(self) -> Schedule:
        return self.view.schedule

    @property
    def world(self) -> int:
        return self.view.layout.world

    @functools.cached_property
    def job(self) -> str:
        return job_of(self.request)

    def field_infos(self) -> list[Any]:
        return [
            pb.FieldInfo(
                name=n,
                dtype=np.dtype(fi.dtype).str,
                shape=list(fi.shape),
                spatial_axes=list(fi.spatial_axes),
            )
            for n, fi in self.info.items()
        ]

    def stream(self, r: Any, shared_memory: bool) -> Stream:
        """A stream for the ``StreamBatchesRequest`` ``r`` (counted until it is released)."""
        if not 0 <= r.rank < self.world:
            raise ServiceError("INVALID_ARGUMENT", f"rank {r.rank} outside 0..{self.world - 1}")
        steps = self.schedule.steps_per_epoch
        if r.start_step > steps:
            raise ServiceError("INVALID_ARGUMENT", f"start_step {r.start_step} outside 0..{steps}")
        if r.prefetch > MAX_PREFETCH:
            raise ServiceError("INVALID_ARGUMENT", f"prefetch {r.prefetch} above {MAX_PREFETCH}")
        end = steps if r.max_batches == 0 else min(steps, r.start_step + r.max_batches)
        view = self.view.of_rank(int(r.rank))
        lay = view.layout
        epoch = int(r.epoch)
        sched = self.schedule

        def plan(step: int) -> np.ndarray:
            return sched.rank_samples(epoch, step, lay.data_rank, lay.data_world)

        fields = list(view.fields)

        def fetch(samples: np.ndarray, out: dict[str, np.ndarray]) -> Fetching | None:
            return self.resident.start_fetch(samples, fields, self.spatial, lay.spatial_rank, out)

        sharded = self.resident.owner is not None

        with self.lock:
            if self.closed:
                raise ServiceError("NOT_FOUND", f"session {self.session_id} is closed")
            if self.failed:
                raise ServiceError("ABORTED", self.failed)
            ring = self.rings.get((int(r.rank), shared_memory))
            if ring is None:
                # the client holds prefetch + 1 batches (RemoteBatches), the producer fills
                # prefetch ahead, one is in flight
                prefetch = int(r.prefetch) or 2
                nslots = prefetch + (prefetch + 2 if shared_memory else 1)
                batch = view.local_batch
                ring_bytes = nslots * batch * sum(f.nbytes for f in fields)
                if self.residency is None:
                    ring_bytes = 0
                elif shared_memory:
                    self.residency.reserve_ring(ring_bytes)
                else:  # (apart from the rings: a job whose ring did not fit streams inline)
                    self.residency.reserve_inline(ring_bytes, nslots)
                try:
                    ring = SlotRing(fields, batch, nslots, shared_memory, self.gather)
                except BaseException as exc:
                    self._unbudget(ring_bytes, shared_memory)
                    if isinstance(exc, OSError | ValueError):  # DATASTORE_SHM_DIR removed...
                        raise ServiceError(
                            "UNAVAILABLE", f"no shared-memory segment for the stream: {exc}"
                        ) from exc
                    raise
                ring.budgeted = ring_bytes
                self.rings[(int(r.rank), shared_memory)] = ring
            s = Stream(
                plan=plan,
                sample=self.resident.sample,
                fetch=fetch if sharded else None,
                steps=(epoch, int(r.start_step), end, steps, int(r.rank)),
                ring=ring,
                on_stall=self._stalled,
                gather=self.gather,
                fetch_ahead=FETCH_AHEAD,  # (bounded by the free slots, where fetches land)
            )
            if shared_memory:  # the rank's newest stream takes over its slots
                for old in self.streams:
                    if old.ring is ring:
                        old.supersede()
            ring.keep_only(list(r.held), s)
            self.streams.add(s)
        return s

    def _stalled(self, seconds: float) -> None:
        with self.lock:
            self.stall_s += seconds

    def served(self, nbytes: int, batch: bool = True) -> None:
        """``nbytes`` more sent; ``batch``: they start a batch (not a later chunk of one)."""
        with self.lock:
            self.batches_served += int(batch)
            self.bytes_served += nbytes

    def release(self, s: Stream) -> None:
        """End ``s`` (again: a no-op). An inline ring that no other stream uses ends with it,
        and what it counted in the memory budget goes back: it was held until the session
        closed, and a client that stopped its stream and kept its session had another's
        refused ``RESOURCE_EXHAUSTED``. A shared-memory ring stays for the session: the client
        may still read its slots, and the rank's next stream takes them over."""
        s.close()
        with self.lock:
            self.streams.discard(s)
            self.last_active = time.monotonic()
            ring, key = s.ring, (s.rank, False)  # (the key of the rank's inline ring)
            unused = (
                ring.segment is None
                and self.rings.get(key) is ring  # (not a later stream's, after a release)
                and all(o.ring is not ring for o in self.streams)
            )
            if unused:
                del self.rings[key]
        if unused:
            self._unbudget(ring.budgeted, False)

    def fail(self, why: str) -> list[Stream]:
        """Its job failed (``why``): new streams are refused ``ABORTED`` saying so; its streams
        still open, to be ended the same way."""
        with self.lock:
            self.failed = self.failed or why
            return list(self.streams)

    def idle_s(self) -> float:
        with self.lock:
            return 0.0 if self.streams else time.monotonic() - self.last_active

    def close(self, why: str = "the session was closed") -> None:
        with self.lock:
            self.closed = True
            streams, self.streams = list(self.streams), set()
            rings, self.rings = list(self.rings.values()), {}
        for s in streams:
            s.close(why)
        for ring in rings:
            ring.close()
            self._unbudget(ring.budgeted, ring.segment is not None)

    def _unbudget(self, nbytes: int, shared_memory: bool) -> None:
        """Give back the ``nbytes`` a ring counted in the memory budget."""
        if not nbytes:
            return
        if shared_memory:
            self.residency.release_ring(nbytes)
        else:
            self.residency.release_inline(nbytes)


class Sessions:
    """The open sessions of one service, on the datasets of its :class:`Residency`.

    Args:
        residency: the resident datasets.
        roots: datasets must lie under one of these. Default: anywhere.
        idle_s: close sessions without a stream for this long. Default: ``600``.
        on_event: ``on_event(name, **fields)`` for the log. Default: nothing.
        gather: the batch copies of every stream. Default: one thread per stream.
    """

    def __init__(
        self,
        residency: Residency,
        roots: tuple[Path, ...] = (),
        idle_s: float = 600.0,
        on_event: Any = None,
        gather: Gather | None = None,
    ) -> None:
        self.residency, self.roots, self.idle_s = residency, roots, idle_s
        self.gather = gather
        self._event = on_event or (lambda *_a, **_k: None)
        self._lock = threading.Lock()
        self._by_id: dict[str, Session] = {}
        self._by_pid: dict[int, set[str]] = {}  # watched client processes and their sessions
        self._watch = ProcessWatch(self._client_ended)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="datastore-reaper", daemon=True)
        self._reaper.start()

    def open(self, r: Any) -> Session:
        path = resolve_dataset(node_path(r.dataset_path, self.residency.node), self.roots)
        if not 0 < r.global_batch <= MAX_GLOBAL_BATCH:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"global_batch must be in 1..{MAX_GLOBAL_BATCH}, got {r.global_batch}",
            )
        world = r.world_size or 1
        if world > MAX_WORLD:
            raise ServiceError("INVALID_ARGUMENT", f"world_size {world} above {MAX_WORLD}")
        spatial = spatial_of(r.spatial)
        if spatial and 0 in spatial["parts"]:
            raise ServiceError("INVALID_ARGUMENT", "spatial parts must be 1 or more, got a 0")
        blocks = math.prod(spatial["parts"]) if spatial else 1
        if world % blocks:
            raise ServiceError(
                "INVALID_ARGUMENT",
                f"world_size {world} is not a multiple of the {blocks} spatial blocks",
            )
        resident = self.residency.acquire(path, r.dataset_path)
        try:
            resident.check_loaded()
            session = self._session(r, resident, world, spatial)
        except BaseException:
            self.residency.release(resident)
            raise
        with self._lock:
            stopping = self._stop.is_set()  # close_all ran while this session was made
            if not stopping:
                self._by_id[session.session_id] = session
        if stopping:
            self._end(session, "the service is stopping")
            raise ServiceError("UNAVAILABLE", "the service is stopping")
        if r.HasField("client"):
            self._watch_client(session.session_id, r.client)
        return session

    def _watch_client(self, sid: str, client: Any) -> None:
        """End session ``sid`` with its client process, if that process can be watched."""
        pid = int(client.pid)
        with self._lock:  # listed first: a process that ends at once still finds it
            self._by_pid.setdefault(pid, set()).add(sid)
        if not self._watch.watch(pid, int(client.start_ticks), client.boot_id):
            with self._lock:
                self._forget_pid(pid, sid)

    def _forget_pid(self, pid: int, sid: str) -> None:
        sids = self._by_pid.get(pid, set())
        sids.discard(sid)
        if not sids:
            self._by_pid.pop(pid, None)

    def _client_ended(self, pid: int) -> None:
        """The watched process ``pid`` ended: close its sessions now."""
        with self._lock:
            sids = self._by_pid.pop(pid, set())
        for sid in sorted(sids):
            try:
                self.close(sid, "its client process ended")
            except ServiceError:
                continue  # closed meanwhile
            self._event("session_client_ended", session=sid, pid=pid)

    def _session(self, r: Any, resident: Resident, world: int, spatial: Any) -> Session:
        if not len(resident.reader):
            raise ServiceError(
                "INVALID_ARGUMENT", f"{shown(r.dataset_path)}: the dataset has no samples"
            )
        try:  # (it named the field, not the dataset)
            info = chosen_fields(resident.reader.fields, list(r.fields), shown)
        except ValueError as exc:
            raise ServiceError("INVALID_ARGUMENT", f"{shown(r.dataset_path)}: {exc}") from exc
        try:
            view = rank_view(
                info,
                len(resident.reader),
                rank=0,
                world=world,
                global_batch_size=r.global_batch,
                seed=r.seed,
                shuffle=r.shuffle_mode or r.shuffle,
                drop_last=r.drop_last,
                spatial=spatial,
            )
        except (ValueError, TypeError) as exc:
            raise ServiceError("INVALID_ARGUMENT", str(exc)) from exc
        session = Session(uuid.uuid4().hex, r, resident, view, info, spatial)
        session.gather, session.residency = self.gather, self.residency
        return session

    def get(self, sid: str) -> Session:
        with self._lock:
            s = self._by_id.get(sid)
        if s is None:
            raise ServiceError("NOT_FOUND", f"no session {shown(sid)}")
        return s

    def close(self, sid: str, why: str = "the session was closed") -> None:
        with self._lock:
            s = self._by_id.pop(sid, None)
            if s is not None and s.request.HasField("client"):
                self._forget_pid(int(s.request.client.pid), sid)
        if s is None:
            raise ServiceError("NOT_FOUND", f"no session {shown(sid)}")
        self._end(s, why)

    def _end(self, s: Session, why: str) -> None:
        """Close ``s`` (no longer listed) and let its dataset go."""
        s.close(why)
        self.residency.release(s.resident)

    def fail_job(self, job: str, why: str) -> list[tuple[Session, Stream]]:
        """A stream of ``job`` (:func:`job_of`) failed: fail its sessions here
        (:meth:`Session.fail`); their streams still open, to be ended."""
        return [(s, st) for s in self.all() if s.job == job for st in s.fail(why)]

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._by_id.values())

    def _reap(self) -> None:
        while not self._stop.wait(min(1.0, self.idle_s / 4)):
            for s in self.all():
                idle = s.idle_s()
                if idle > self.idle_s:
                    try:
                        self.close(s.session_id, "the session expired")
                    except ServiceError:
                        continue  # closed meanwhile
                    self._event("session_expired", session=s.session_id, idle_s=round(idle, 1))

    def close_all(self) -> None:
        self._stop.set()
        self._watch.close()
        with self._lock:
            sessions, self._by_id = list(self._by_id.values()), {}
        for s in sessions:
            self._end(s, "the service is stopping")

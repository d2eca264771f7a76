"""Sessions of ``datastore serve``: the embedded loaders that produce each rank's batches.

A session fixes the sample sequence of one job (dataset, seed, global batch, world size,
spatial layout). Each rank's batches come from a ``DataStoreLoader`` embedded in the server
(``exchange=False``: the server reads every block it serves itself), created the first time
that rank streams and kept until ``CloseSession``. A rank streams under its loader's lock, so
two streams of one rank run one after the other, never interleaved.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datastore.loader import DataStoreLoader
from datastore.service._pb.v1 import datastore_pb2 as pb

__all__ = ["MAX_GLOBAL_BATCH", "Session", "SessionError", "Sessions"]

MAX_GLOBAL_BATCH = 1_000_000


class SessionError(Exception):
    """A request that cannot be served; ``code`` names the gRPC status (``NOT_FOUND``...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _spatial(layout: Any) -> dict[str, Any] | None:
    if not layout.parts:
        return None
    out: dict[str, Any] = {"parts": tuple(layout.parts)}
    if layout.halo:
        out["halo"] = tuple(layout.halo)
    if layout.boundary:
        out["boundary"] = layout.boundary
    return out


@dataclass
class Session:
    """One open session and its per-rank loaders."""

    session_id: str
    request: Any  # the OpenSessionRequest
    world: int
    spatial: dict[str, Any] | None
    num_samples: int
    steps_per_epoch: int
    fields: list[Any]
    opened_unix_s: float = field(default_factory=time.time)
    loaders: dict[int, DataStoreLoader] = field(default_factory=dict)
    locks: dict[int, threading.Lock] = field(default_factory=dict)
    batches_served: int = 0
    bytes_served: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def _loader(self, rank: int, preload: bool = True) -> DataStoreLoader:
        r = self.request
        return DataStoreLoader(
            r.dataset_path,
            global_batch_size=r.global_batch,
            seed=r.seed,
            shuffle=r.shuffle,
            drop_last=r.drop_last,
            spatial=self.spatial,
            rank=rank,
            world=self.world,
            exchange=False,
            preload=preload,
        )

    def rank(self, rank: int) -> tuple[DataStoreLoader, threading.Lock]:
        """The loader of ``rank`` (created on first use) and the lock to stream it under."""
        if not 0 <= rank < self.world:
            raise SessionError("INVALID_ARGUMENT", f"rank {rank} outside 0..{self.world - 1}")
        with self.lock:
            if self.closed:
                raise SessionError("NOT_FOUND", f"session {self.session_id} is closed")
            if rank not in self.loaders:
                self.loaders[rank] = self._loader(rank)
                self.locks[rank] = threading.Lock()
            return self.loaders[rank], self.locks[rank]

    def batches(
        self, rank: int, epoch: int, start: int, max_batches: int, active: Any
    ) -> Iterator[Any]:
        """``Batch`` messages of ``rank`` in ``epoch`` from step ``start``, inline bytes.

        Pulled one at a time by gRPC: the loader prepares at most ``prefetch`` batches ahead,
        so a slow client never makes this buffer more. Stops when ``active()`` turns false."""
        loader, lock = self.rank(rank)
        steps = loader.schedule.steps_per_epoch
        if start > steps:
            raise SessionError("INVALID_ARGUMENT", f"start_step {start} outside 0..{steps}")
        end = steps if max_batches == 0 else min(steps, start + max_batches)
        if not lock.acquire(timeout=30):
            raise SessionError("RESOURCE_EXHAUSTED", f"rank {rank} is already being streamed")
        try:
            loader.epoch, loader._step = int(epoch), int(start)
            order = loader.schedule.order(loader.epoch)
            lay = loader.layout
            it = iter(loader)
            try:
                for step in range(start, end):
                    if not active():
                        return
                    batch = next(it)
                    g = loader.schedule.global_batch_at(loader.epoch, step, order)
                    mine = loader.schedule.rank_batch(g, lay.data_rank, lay.data_world)
                    tensors = []
                    nbytes = 0
                    for f in loader.fields:
                        arr = np.ascontiguousarray(batch[f.name].numpy())
                        origin = [r.start - a for r, (a, _) in zip(f.region, f.pad, strict=True)]
                        data = arr.tobytes()
                        nbytes += len(data)
                        meta = pb.TensorMeta(
                            name=f.name,
                            dtype=arr.dtype.str,
                            shape=list(arr.shape),
                            origin=origin,
                            nbytes=len(data),
                        )
                        tensors.append(pb.Tensor(meta=meta, data=data))
                    with self.lock:
                        self.batches_served += 1
                        self.bytes_served += nbytes
                    yield (
                        pb.Batch(
                            epoch=epoch,
                            step=step,
                            rank=rank,
                            sample_indices=[int(i) for i in mine],
                            tensors=tensors,
                            last_in_epoch=step == steps - 1,
                        ),
                        nbytes,
                    )
            finally:
                it.close()  # stops the loader's prefetch thread
        finally:
            lock.release()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            loaders, self.loaders = self.loaders, {}
        for loader in loaders.values():
            loader.close()


class Sessions:
    """The open sessions of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Session] = {}

    def open(self, r: Any) -> Session:
        path = r.dataset_path
        if not path:
            raise SessionError("NOT_FOUND", "dataset_path is empty")
        if not os.path.exists(path):
            raise SessionError("NOT_FOUND", f"no dataset at {path!r} on this node")
        if not 0 < r.global_batch <= MAX_GLOBAL_BATCH:
            raise SessionError(
                "INVALID_ARGUMENT",
                f"global_batch must be in 1..{MAX_GLOBAL_BATCH}, got {r.global_batch}",
            )
        world = r.world_size or 1
        spatial = _spatial(r.spatial)
        blocks = int(np.prod(spatial["parts"])) if spatial else 1
        if blocks < 1 or world % blocks:
            raise SessionError(
                "INVALID_ARGUMENT",
                f"world_size {world} is not a multiple of the {blocks} spatial blocks",
            )
        sid = uuid.uuid4().hex
        session = Session(sid, r, world, spatial, 0, 0, [])
        try:  # rank 0's loader, not preloaded: checks everything and gives the layout
            probe = session._loader(0, preload=False)
        except (ValueError, TypeError) as exc:
            raise SessionError("INVALID_ARGUMENT", str(exc)) from exc
        except OSError as exc:
            raise SessionError("NOT_FOUND", f"cannot open {path!r}: {exc}") from exc
        try:
            session.num_samples = len(probe.reader)
            session.steps_per_epoch = len(probe)
            session.fields = [
                pb.FieldInfo(
                    name=n,
                    dtype=np.dtype(fi.dtype).str,
                    shape=list(fi.shape),
                    spatial_axes=list(fi.spatial_axes),
                )
                for n, fi in probe.reader.fields.items()
            ]
        finally:
            probe.close()
        with self._lock:
            self._by_id[sid] = session
        return session

    def get(self, sid: str) -> Session:
        with self._lock:
            s = self._by_id.get(sid)
        if s is None:
            raise SessionError("NOT_FOUND", f"no session {sid!r}")
        return s

    def close(self, sid: str) -> None:
        with self._lock:
            s = self._by_id.pop(sid, None)
        if s is None:
            raise SessionError("NOT_FOUND", f"no session {sid!r}")
        s.close()

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._by_id.values())

    def close_all(self) -> None:
        with self._lock:
            sessions, self._by_id = list(self._by_id.values()), {}
        for s in sessions:
            s.close()

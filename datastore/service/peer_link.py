"""What the services of one store share, whichever link carries their requests: over MPI
(:mod:`datastore.service.mpi_peers`, ``mpiexec -n K datastore serve``) or over gRPC
(:mod:`datastore.service.grpc_peers`).

Each service owns the samples staged on its node's disk. When a dataset is sharded (``datastore
stage --mode shard``: nodes hold different files under the same path), a service asks every
peer which files it holds (``describe``), and from then on fetches from their owners the blocks
its local trainer ranks need (``fetch``): the owner sends block ``k``'s part inside the volume
straight from its resident sample, as the sample's contiguous runs (:class:`Pieces`), and the
asker's link writes the zero halo around it right after. A session's stream asks for a batch's
remote samples as soon as it has the slot they go to, every owner at once, up to several
batches ahead (:meth:`Peers.start` returns at once), and the runs land straight in the slot
(:data:`Segments`); a part that is not contiguous there (a block amid its halo) lands in a
reused buffer and is copied in, its halo outside the volume zeroed right after (while its
lines are still in the cache: a batch's halos zeroed apart cost 10% more).

A dataset path may contain ``{node}``, filled in by each service with its own rank (several
services on one host, as in tests).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from datastore.maths.subarray import MIN_RUN, outside, pieces, view

__all__ = [
    "Box",
    "Listing",
    "Peers",
    "Pending",
    "Pieces",
    "Segments",
    "cut_into",
    "expect",
    "fitted",
    "nbytes",
    "node_path",
    "sizes_of",
    "targets",
    "zero_rest",
]

Listing = tuple[bool, list[str], dict[str, tuple[str, tuple[int, ...]]]]
"""``(shardable, files held here, {field: (dtype, shape)})``: a node's view of a dataset."""


@dataclass(frozen=True)
class Pieces:
    """A ``fetch`` reply sent straight from the store: the bytes of each ``array[box]`` of
    ``boxes`` (``(array, box)``), one after the other, as messages of contiguous runs."""

    boxes: Sequence[tuple[np.ndarray, tuple[slice, ...]]]

    def runs(self) -> list[np.ndarray]:
        """The bytes to send, in order, as 1-d uint8 views of the arrays where the boxes'
        parts are contiguous; a box cut into runs shorter than :data:`MIN_RUN` on average is
        packed (one copy): :func:`~datastore.maths.subarray.pieces`."""
        return [p for array, box in self.boxes for p in pieces(array, box, MIN_RUN)]


def cut_into(runs: list[int], sizes: list[int]) -> list[tuple[int, int, int]] | None:
    """Where each of the messages ``runs`` (bytes) lands in buffers of ``sizes`` filled one
    after the other: ``[(buffer, start, stop)]``; ``None`` if one straddles two buffers or
    the totals differ."""
    out, k, at = [], 0, 0
    for n in runs:
        while k < len(sizes) and at == sizes[k] and n:
            k, at = k + 1, 0
        if n and (k == len(sizes) or at + n > sizes[k]):
            return None
        out.append((k if n else 0, at, at + n))
        at += n
    if sum(runs) != sum(sizes):
        return None
    return out


def expect(sizes: Sequence[int]) -> list[list[int]]:
    """A fetch request's ``expect``: the sizes of the messages its reply comes in (as the
    asker computes them: :func:`~datastore.maths.subarray.piece_sizes`), run-length coded
    (``[[size, count], ...]``: a block of many equal runs stays a short request)."""
    out: list[list[int]] = []
    for n in sizes:
        if out and out[-1][0] == n:
            out[-1][1] += 1
        else:
            out.append([int(n), 1])
    return out


def sizes_of(expected: Sequence[Sequence[int]]) -> list[int]:
    """The message sizes an :func:`expect` list codes."""
    return [n for n, count in expected for _ in range(count)]


def fitted(raw: list[np.ndarray], sizes: list[int]) -> list[np.ndarray] | None:
    """``raw`` (1-d uint8 messages) as messages of ``sizes``: itself where they match, else
    its bytes copied and cut into them (a sample not stored C-contiguous); ``None`` where
    the totals differ."""
    if [r.nbytes for r in raw] == sizes:
        return raw
    if sum(r.nbytes for r in raw) != sum(sizes):
        return None
    whole = np.concatenate(raw) if raw else np.empty(0, np.uint8)
    return np.split(whole, np.cumsum(sizes)[:-1].tolist()) if sizes else []


def node_path(path: str, node: int) -> str:
    """``path`` with ``{node}`` replaced by this service's rank."""
    return path.replace("{node}", str(node))


Box = tuple[np.ndarray, tuple[slice, ...]]
"""``(array, box)``: a C-contiguous array whose part ``array[box]`` a fetch writes in place,
the rest zeroed (:func:`zero_rest`): a block's box, its part inside the volume amid its halo."""

Segments = np.ndarray | Sequence[np.ndarray | Box]
"""Where a fetch's bytes land: one uint8 buffer, or several filled one after the other, and
:data:`Box` parts."""


def targets(out: Segments) -> list[np.ndarray | Box]:
    """``out`` as a list of its parts: 1-d uint8 buffers (the non-empty ones) and boxes."""
    parts = [out] if isinstance(out, np.ndarray) else out
    return [t for t in parts if isinstance(t, tuple) or t.nbytes]


def zero_rest(target: np.ndarray | Box) -> None:
    """Zero a :data:`Box`'s array outside its box, once its part is written (a buffer: no-op)."""
    if isinstance(target, tuple):
        array, box = target
        for slab in outside(array.shape, box):
            array[slab] = 0


def nbytes(target: np.ndarray | Box) -> int:
    """The bytes a fetch writes into ``target``."""
    return view(*target).nbytes if isinstance(target, tuple) else target.nbytes


class Pending:
    """A request in flight: :meth:`wait` for it, then :meth:`result` (its reply, or its
    error); :meth:`abandon` it if it is no longer wanted. A fetch's buffers stay lent to it
    until :meth:`freed`: one that failed while its bytes were coming (a receive MPI could not
    cancel) is over before they stopped landing."""

    def __init__(
        self,
        done: threading.Event,
        result: Callable[[], Any],
        abandon: Callable[[], None] = lambda: None,
        freed: threading.Event | None = None,
    ) -> None:
        self._done, self.result, self.abandon = done, result, abandon
        self._freed = done if freed is None else freed

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is over (its reply in, or failed), waiting up to ``timeout`` s."""
        return self._done.wait(timeout)

    def freed(self, timeout: float | None = None) -> bool:
        """Whether no byte can land in its buffers any more, waiting up to ``timeout`` s."""
        return self._freed.wait(timeout)


class Peers(Protocol):
    """What a service asks of the other services of its store (over MPI or gRPC)."""

    node: int  # this service's index in the store
    nodes: int
    bytes_received: int

    def describe(self, dest: int, path: str) -> Listing:
        """Node ``dest``'s :data:`Listing` of the dataset clients call ``path``."""
        ...

    def start(self, dest: int, request: dict, out: Segments) -> Pending:
        """Ask node ``dest`` for blocks, to land in ``out`` one after the other: what
        :meth:`Resident.pieces` answers (the parts inside the volume); returns at once."""
        ...

    def fetch(self, dest: int, request: dict, out: Segments) -> None:
        """:meth:`start`, waiting for the blocks."""
        ...

    def tell_all(self, request: dict) -> None:
        """Send ``request`` (``{"kind": "job_failed", ...}``) to every other node, expecting
        no reply; returns at once."""
        ...

    def close(self, *, stop_all: bool) -> None:
        """Stop answering; ``stop_all``: this service is stopping on its own account."""
        ...

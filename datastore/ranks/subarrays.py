"""Boxes of arrays sent and received over MPI as contiguous messages, and reused buffers.

A part ``array[box]`` goes straight from its array as the messages
:func:`~datastore.maths.subarray.pieces` cuts it into (its contiguous runs, or one packed
buffer where they are short); a receiver posts messages of the sizes the sender's array shape
implies (:func:`~datastore.maths.subarray.piece_sizes`), straight into the box where it is
contiguous, else into a buffer aside copied in once they are in. MPI derived datatypes would
spare those copies, but in mpich 5 a subarray type moves 0.01-0.9 GB/s where contiguous bytes
move 2-12 GB/s. Buffers aside and packed are reused (:class:`Asides`): fresh memory costs a
page fault per page every time. The buffers of a round that failed are never freed
(:func:`keep_until_exit`): MPI may still move their bytes.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from datastore.maths.subarray import piece_sizes, pieces, view

__all__ = ["ASIDE_KEPT", "Asides", "BoxMessages", "keep_until_exit"]

ASIDE_KEPT = 128 << 20  # bytes of buffers aside kept for reuse, at most


def keep_until_exit(obj: object) -> None:
    """Never free ``obj``, nor what it holds, not even when Python finalizes: the buffers of
    sends and receives that did not end (a round that failed, a link closed mid-transfer) must
    outlive ``MPI_Finalize``, which mpi4py calls after Python freed its objects and which may
    still move their bytes (Open MPI did, into freed memory: a segfault at exit)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class Asides:
    """Buffers for parts received aside (or packed), reused; at most ``limit`` bytes kept.
    Any thread."""

    def __init__(self, limit: int = ASIDE_KEPT) -> None:
        self._limit, self._kept = limit, 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            if self._free.get(n):
                self._kept -= n
                return self._free[n].pop()
        return np.empty(n, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._kept + buf.nbytes <= self._limit:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._kept += buf.nbytes


class BoxMessages:
    """One round of sends and receives of boxes over ``comm`` (one thread): post them with
    :meth:`send` and :meth:`recv`, complete the requests, then run :meth:`unpacks` and
    :meth:`release` the buffers aside for the next round (or :meth:`abandon` a failed round).

    Args:
        comm: an mpi4py communicator.
        asides: the buffers to reuse. Default: a pool of its own.
    """

    def __init__(self, comm: Any, asides: Asides | None = None) -> None:
        self.comm = comm
        self.asides = asides or Asides()
        self._held: list[np.ndarray] = []  # buffers aside of the round in flight
        self._unpacks: list[tuple[np.ndarray, np.ndarray]] = []  # (part, its buffer aside)

    def send(self, array: np.ndarray, box: tuple[slice, ...], dest: int, tag: int = 0) -> list:
        """Requests sending ``array[box]`` (``array`` C-contiguous, left alone until they
        complete) to ``dest`` as the messages of :func:`piece_sizes`."""
        if not array.flags.c_contiguous:
            raise ValueError(f"a box of an array that is not C-contiguous ({array.strides})")
        sizes = piece_sizes(array.shape, array.itemsize, box)
        pack = None
        if len(sizes) == 1 and not view(array, box).flags.c_contiguous:
            pack = self._take(sizes[0])
        return [self.comm.Isend(p, dest, tag) for p in pieces(array, box, pack=pack)]

    def recv(
        self,
        array: np.ndarray,
        box: tuple[slice, ...],
        sender: tuple[tuple[int, ...], tuple[slice, ...]],
        source: int,
        tag: int = 0,
    ) -> list:
        """Requests receiving into ``array[box]`` what ``source`` sends with :meth:`send`:
        ``sender = (shape, box)``, the part ``box`` (the same extents) of an array of
        ``shape`` there."""
        part = view(array, box)
        sizes = piece_sizes(sender[0], array.itemsize, sender[1])
        if sum(sizes) != part.nbytes:
            raise ValueError(f"{sender[1]} of {sender[0]} is {sum(sizes)} bytes, not {part.nbytes}")
        if part.flags.c_contiguous:
            into = part.reshape(-1).view(np.uint8)
        else:
            into = self._take(part.nbytes)
            self._unpacks.append((part, into))
        requests, at = [], 0
        for n in sizes:
            requests.append(self.comm.Irecv(into[at : at + n], source, tag))
            at += n
        return requests

    def unpacks(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The copies ``(part, its bytes aside)`` that put parts received aside in place, to
        run once the round's receives are complete."""
        return [(p, a.view(p.dtype).reshape(p.shape)) for p, a in self._unpacks]

    def release(self) -> None:
        """The round is over (its requests complete, its :meth:`unpacks` run): its buffers
        aside go back for reuse."""
        for b in self._held:
            self.asides.give(b)
        self._held, self._unpacks = [], []

    def abandon(self, requests: list[Any]) -> None:
        """The round failed (its ``requests`` may never complete): they, the buffers they
        send from and receive into (an mpi4py request holds its buffer) and the buffers aside
        are kept until the process exits (:func:`keep_until_exit`), never reused."""
        keep_until_exit((self._held, requests))
        self._held, self._unpacks = [], []

    def _take(self, n: int) -> np.ndarray:
        self._held.append(self.asides.take(n))
        return self._held[-1]

"""A box of an array as the contiguous messages it travels in over MPI.

Both MPI exchanges (the embedded one between a job's ranks, the services' link between nodes)
send the part ``array[box]`` of a stored sample straight from it: as its contiguous runs of
bytes, one message each (:func:`runs`), or, where the runs are short (a block cut on the last
axis), packed into one message (:func:`pieces`). MPI derived datatypes would spare the packing
and the receiver's copy, but in mpich 5 (shared memory) a subarray type moves 0.01-0.9 GB/s
where contiguous bytes move 2-12 GB/s. A receiver that knows the sender's array shape computes
the messages' sizes without being told (:func:`piece_sizes`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

__all__ = [
    "MIN_RUN",
    "outside",
    "piece_sizes",
    "pieces",
    "run_bytes",
    "run_layout",
    "runs",
    "view",
]

MIN_RUN = 64 * 1024  # a part cut into runs shorter than this on average is packed instead


def view(array: np.ndarray, box: tuple[slice, ...]) -> np.ndarray:
    """The view ``array[box]``, a 0-d array's too (``array[()]`` would be a copy, a scalar)."""
    return array[(*box, ...)]


def outside(shape: tuple[int, ...], box: tuple[slice, ...]) -> list[tuple[slice, ...]]:
    """Disjoint slabs covering an array of ``shape`` less its part ``box`` (step-1 slices),
    few and large: on each axis in turn, what lies before and after ``box`` there, within
    ``box`` on the axes before it and whole on those after."""
    slabs, before = [], []
    for axis, (s, n) in enumerate(zip(box, shape, strict=True)):
        start, stop, _ = s.indices(n)
        rest = (slice(None),) * (len(shape) - axis - 1)
        if start > 0:
            slabs.append((*before, slice(0, start), *rest))
        if stop < n:
            slabs.append((*before, slice(stop, n), *rest))
        before.append(slice(start, stop))
    return slabs


def run_layout(shape: tuple[int, ...], box: tuple[slice, ...]) -> tuple[int, int]:
    """``(runs, items per run)`` of ``array[box]`` in a C-contiguous array of ``shape``: the
    number of contiguous runs its items lie in, in C order, and their length; ``(0, 0)`` for
    an empty part, ``(1, 1)`` for a 0-d array.

    Raises:
        ValueError: ``box`` is not one step-1 slice within ``shape`` per axis.
    """
    extents, lead = _cut(shape, box)
    if not math.prod(extents):
        return 0, 0
    return math.prod(extents[:lead]), math.prod(extents[lead:])


def _cut(shape: tuple[int, ...], box: tuple[slice, ...]) -> tuple[list[int], int]:
    """``box``'s extent on each axis, and how many leading axes its runs are taken over (the
    trailing whole axes, and the first part-covered one, make one run)."""
    if len(box) != len(shape):
        raise ValueError(f"a box of {len(box)} axes for an array of shape {shape}")
    extents = []
    for s, n in zip(box, shape, strict=True):
        start, stop = 0 if s.start is None else s.start, n if s.stop is None else s.stop
        if s.step not in (None, 1):
            raise ValueError(f"box {box} is not step-1 slices")
        if not 0 <= start <= stop <= n:
            raise ValueError(f"box {box} is not within shape {shape}")
        extents.append(stop - start)
    lead = len(shape)
    while lead > 0:
        lead -= 1
        if extents[lead] != shape[lead]:
            break
    return extents, lead


def piece_sizes(
    shape: tuple[int, ...], itemsize: int, box: tuple[slice, ...], min_run: int = MIN_RUN
) -> list[int]:
    """The sizes in bytes of the messages :func:`pieces` cuts ``array[box]`` into, for a
    C-contiguous array of ``shape`` and ``itemsize``: what a receiver posts, untold."""
    count, items = run_layout(shape, box)
    if _packed(count, items * itemsize, min_run):
        return [count * items * itemsize]
    return [items * itemsize] * count


def run_bytes(part: np.ndarray) -> int:
    """The length of the contiguous runs ``part``'s bytes lie in (a uint8 view, in C order)."""
    run = 1
    for n, stride in zip(reversed(part.shape), reversed(part.strides), strict=True):
        if stride != run:
            break
        run *= n
    return run


def runs(part: np.ndarray) -> list[np.ndarray]:
    """The contiguous runs of a strided view, in C order, as 1-d uint8 views of its memory."""
    if part.flags.c_contiguous:
        return [part.reshape(-1).view(np.uint8)]
    return [r for sub in part for r in runs(sub)]


def pieces(
    array: np.ndarray,
    box: tuple[slice, ...],
    min_run: int = MIN_RUN,
    pack: np.ndarray | None = None,
) -> list[np.ndarray]:
    """The bytes of ``array[box]`` to send, in order: 1-d uint8 views of ``array``'s contiguous
    runs, or, where they are shorter than ``min_run`` on average, the part packed into one
    (into ``pack``, 1-d uint8 of its size, where given: a copy); none for an empty part. For a
    C-contiguous array their sizes are :func:`piece_sizes`."""
    if array.flags.c_contiguous and array.ndim == len(box):  # (a stored sample: its runs kept)
        bounds = tuple((s.start, s.stop, s.step) for s in box)
        starts, run = _run_starts(array.shape, array.dtype.itemsize, bounds, min_run)
        if run:
            flat = array.reshape(-1).view(np.uint8)
            return [flat[at : at + run] for at in starts]
    part = view(array, box)
    if not part.nbytes:
        return []
    if part.flags.c_contiguous:
        return [part.reshape(-1).view(np.uint8)]
    cut = None
    if array.flags.c_contiguous:  # counted without cutting: a packed part may have many runs
        count = run_layout(array.shape, box)[0]
    else:
        cut = runs(part)
        count = len(cut)
    if part.nbytes >= min_run * count:
        return cut if cut is not None else runs(part)
    if pack is None:
        pack = np.empty(part.nbytes, np.uint8)
    np.copyto(pack.view(part.dtype).reshape(part.shape), part)
    return [pack]


def _packed(count: int, run: int, min_run: int) -> bool:
    """Whether a part of ``count`` runs of ``run`` bytes is packed into one message (its runs
    shorter than ``min_run``) rather than sent run by run."""
    return count > 1 and run < min_run


@functools.lru_cache(maxsize=1024)
def _run_starts(
    shape: tuple[int, ...], itemsize: int, bounds: tuple[tuple[Any, Any, Any], ...], min_run: int
) -> tuple[tuple[int, ...], int]:
    """Where (bytes) the runs of ``array[box]`` (``bounds``: its slices' start, stop, step)
    begin in a C-contiguous array of ``shape`` and ``itemsize``, and their length: what
    :func:`pieces` sends, computed once per geometry; ``((), 0)`` where it packs the part
    (short runs) or it is empty."""
    box = tuple(slice(*b) for b in bounds)
    extents, lead = _cut(shape, box)
    run = math.prod(extents[lead:]) * itemsize
    count = math.prod(extents[:lead])
    if not run or not count or _packed(count, run, min_run):
        return (), 0
    strides = [math.prod(shape[k + 1 :]) * itemsize for k in range(len(shape))]
    at = np.array([sum((s.start or 0) * st for s, st in zip(box, strides, strict=True))])
    for k in range(lead):  # every run's start: the leading axes' offsets added up
        at = (at[:, None] + np.arange(extents[k]) * strides[k]).ravel()
    return tuple(at.tolist()), run

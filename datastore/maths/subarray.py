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

import math

import numpy as np

__all__ = ["MIN_RUN", "piece_sizes", "pieces", "run_bytes", "run_layout", "runs", "view"]

MIN_RUN = 64 * 1024  # a part cut into runs shorter than this on average is packed instead


def view(array: np.ndarray, box: tuple[slice, ...]) -> np.ndarray:
    """The view ``array[box]``, a 0-d array's too (``array[()]`` would be a copy, a scalar)."""
    return array[(*box, ...)]


def run_layout(shape: tuple[int, ...], box: tuple[slice, ...]) -> tuple[int, int]:
    """``(runs, items per run)`` of ``array[box]`` in a C-contiguous array of ``shape``: the
    number of contiguous runs its items lie in, in C order, and their length; ``(0, 0)`` for
    an empty part, ``(1, 1)`` for a 0-d array.

    Raises:
        ValueError: ``box`` is not one step-1 slice within ``shape`` per axis.
    """
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
    if not math.prod(extents):
        return 0, 0
    run, axis = 1, len(shape)
    while axis > 0:  # trailing whole axes, and the first part-covered one, are one run
        axis -= 1
        run *= extents[axis]
        if extents[axis] != shape[axis]:
            break
    return math.prod(extents[:axis]), run


def piece_sizes(
    shape: tuple[int, ...], itemsize: int, box: tuple[slice, ...], min_run: int = MIN_RUN
) -> list[int]:
    """The sizes in bytes of the messages :func:`pieces` cuts ``array[box]`` into, for a
    C-contiguous array of ``shape`` and ``itemsize``: what a receiver posts, untold."""
    count, items = run_layout(shape, box)
    if count > 1 and items * itemsize < min_run:  # runs shorter than min_run: packed
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

"""A box of an array as an MPI subarray datatype's parameters, counted in bytes.

Both MPI exchanges (the embedded one between a job's ranks, the services' link between nodes)
send a block straight from a stored sample and receive it straight into its place in a batch:
the part ``array[box]`` of a C-contiguous array, described to MPI as a subarray of bytes
(``MPI.BYTE.Create_subarray(sizes, subsizes, starts)``), so one type serves every dtype.
"""

from __future__ import annotations

import numpy as np

__all__ = ["byte_subarray", "view"]


def view(array: np.ndarray, box: tuple[slice, ...]) -> np.ndarray:
    """The view ``array[box]``, a 0-d array's too (``array[()]`` would be a copy, a scalar)."""
    return array[(*box, ...)]


def byte_subarray(
    shape: tuple[int, ...], itemsize: int, box: tuple[slice, ...]
) -> tuple[list[int], list[int], list[int]]:
    """``(sizes, subsizes, starts)`` of ``array[box]`` for an array of ``shape`` and
    ``itemsize``, the last axis in bytes; a 0-d array is its ``itemsize`` bytes.

    Raises:
        ValueError: ``box`` is not one step-1 slice within ``shape`` per axis.
    """
    if len(box) != len(shape):
        raise ValueError(f"a box of {len(box)} axes for an array of shape {shape}")
    starts, subsizes = [], []
    for s, n in zip(box, shape, strict=True):
        if s.step not in (None, 1) or s.start is None or s.stop is None:
            raise ValueError(f"box {box} is not step-1 slices with a start and a stop")
        if not 0 <= s.start <= s.stop <= n:
            raise ValueError(f"box {box} is not within shape {shape}")
        starts.append(s.start)
        subsizes.append(s.stop - s.start)
    if not shape:
        return [itemsize], [itemsize], [0]
    sizes = [*shape[:-1], shape[-1] * itemsize]
    return sizes, [*subsizes[:-1], subsizes[-1] * itemsize], [*starts[:-1], starts[-1] * itemsize]

"""MPI buffers for a box of an array, sent or received in place (no staging copy of ours).

A box whose bytes are contiguous is a plain byte buffer; any other is the whole array with a
committed subarray datatype (:func:`~datastore.maths.subarray.byte_subarray`), cached per shape
and box, so a block goes straight from a stored sample and lands straight in its batch slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from datastore.maths.subarray import byte_subarray, view

__all__ = ["Subarrays"]


class Subarrays:
    """The committed subarray types of one user of MPI (freed by :meth:`free`).

    Args:
        mpi: the ``mpi4py.MPI`` module.
    """

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self._types: dict[tuple, Any] = {}

    def buffer(self, array: np.ndarray, box: tuple[slice, ...]) -> Any:
        """An mpi4py buffer of ``array[box]`` (``array`` C-contiguous): its bytes where they
        are contiguous, else ``[array, 1, subarray type]``."""
        part = view(array, box)
        if part.flags.c_contiguous:
            return part.reshape(-1).view(np.uint8)
        if not array.flags.c_contiguous:
            raise ValueError(f"a box of an array that is not C-contiguous ({array.strides})")
        key = (array.shape, array.itemsize, tuple((s.start, s.stop) for s in box))
        t = self._types.get(key)
        if t is None:
            t = self._mpi.BYTE.Create_subarray(*byte_subarray(array.shape, array.itemsize, box))
            t.Commit()
            self._types[key] = t
        return [array, 1, t]

    def free(self) -> None:
        for t in self._types.values():
            t.Free()
        self._types.clear()

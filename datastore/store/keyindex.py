"""Where a key sits in an array of keys, without a Python object per key.

A store holds up to ``N / P`` samples per rank and is asked, for every sample of every step,
which slot holds it. A dict of the keys costs about 100 B per key (10 GiB per rank for 10^8
samples on one rank); :class:`KeyIndex` costs nothing for keys in arithmetic progression (a
rank's contiguous share, a range of sample indices) and 16 B per key otherwise (the keys
sorted, and their slots), with a binary search per lookup.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KeyIndex"]


class KeyIndex:
    """The slot of each key of ``keys`` (its position in the array); keys must be distinct.

    Raises:
        ValueError: on a repeated key.
    """

    def __init__(self, keys: np.ndarray) -> None:
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        self.size = len(keys)
        self._start = self._step = 0
        self._sorted: np.ndarray | None = None
        self._slots: np.ndarray | None = None
        if self.size == 1:
            self._start, self._step = int(keys[0]), 1
            return
        if self.size > 1:
            step = int(keys[1] - keys[0])
            if step != 0 and bool(np.all(np.diff(keys) == step)):
                self._start, self._step = int(keys[0]), step
                return
            order = np.argsort(keys, kind="stable")
            ordered = keys[order]
            repeated = np.flatnonzero(ordered[1:] == ordered[:-1])
            if len(repeated):
                raise ValueError(f"key {int(ordered[repeated[0]])} appears more than once")
            self._sorted, self._slots = ordered, order

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays (0 for an arithmetic progression)."""
        if self._sorted is None or self._slots is None:
            return 0
        return self._sorted.nbytes + self._slots.nbytes

    def find(self, key: int) -> int:
        """The slot of ``key``, or ``-1`` if it is not one of the keys."""
        key = int(key)
        if self._sorted is None or self._slots is None:
            if self.size == 0:
                return -1
            slot, off = divmod(key - self._start, self._step)
            return slot if off == 0 and 0 <= slot < self.size else -1
        i = int(np.searchsorted(self._sorted, key))
        return int(self._slots[i]) if i < self.size and self._sorted[i] == key else -1

    def __contains__(self, key: int) -> bool:
        return self.find(key) >= 0

    def __getitem__(self, key: int) -> int:
        slot = self.find(key)
        if slot < 0:
            raise KeyError(key)
        return slot

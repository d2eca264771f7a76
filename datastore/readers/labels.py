"""Labels kept as text: ``.cls`` and ``.json`` members decoded to the arrays a batch carries.

- ``.cls``: an integer as text (``"7\\n"``): one ``int64`` scalar.
- ``.json``: parsed; a number, a bool or a rectangular list of them is one array (``int64``
  when every number is an integer, else ``float64``; ``bool``). An object is like a ``.npz``:
  each of its keys (nested objects' keys joined by ``.``) whose value is such an array is a
  field; other values (strings, ``null``, ragged lists) are metadata, not fields.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from datastore.readers.npyfile import check_stamp

__all__ = ["ValueArray", "class_label", "json_arrays"]

_INTEGER = re.compile(rb"\s*[+-]?[0-9]+\s*")
_INT64 = np.iinfo(np.int64)


@dataclass(frozen=True)
class ValueArray:
    """A small decoded array held in memory (a class label, a JSON value)."""

    value: np.ndarray
    path: str | None = field(default=None, kw_only=True)
    """The file it was read from (a tar shard), if a read is to check that file."""
    stamp: tuple[int, int, int, int] | None = field(default=None, kw_only=True)
    """``path``'s ``file_stamp`` when it was read: a read after the file was replaced or
    rewritten is refused, as a ``StoredArray``'s is (its old value was served)."""
    opened: str | None = field(default=None, kw_only=True)
    """``path`` as opened, links resolved: what ``datastore serve --allow`` checks."""

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    def read_into(self, out: np.ndarray, sel: tuple[slice, ...]) -> None:
        """Copy the box ``sel`` into ``out`` (which may widen the dtype: ``int64`` to
        ``float64``).

        Raises:
            ValueError: ``path`` changed since the value was read from it.
        """
        if self.stamp is not None:
            assert self.path is not None  # (set together)
            with open(self.path, "rb") as fh:
                check_stamp(fh.fileno(), self.path, self.stamp)
        np.copyto(out, self.value[sel])


def class_label(data: bytes) -> ValueArray:
    """The integer written in ``data``.

    Raises:
        ValueError: the reason, for anything but one integer in the ``int64`` range.
    """
    if not _INTEGER.fullmatch(data):
        raise ValueError(f"not an integer class label: {data[:40]!r}")
    n = int(data)
    if not _INT64.min <= n <= _INT64.max:
        raise ValueError(f"class label {n} is out of the int64 range")
    return ValueArray(np.asarray(n, dtype=np.int64))


def json_arrays(data: bytes, name: str, prefix: str) -> dict[str, ValueArray]:
    """``{field: array}`` of the JSON document ``data``: one field ``name`` for a value, the
    keys of an object (after ``prefix``) for an object.

    Raises:
        ValueError: the reason, for bytes that are not JSON.
    """
    return _arrays(json.loads(data), name, prefix)


def _arrays(value: Any, name: str, prefix: str) -> dict[str, ValueArray]:
    if isinstance(value, dict):
        out: dict[str, ValueArray] = {}
        for key, v in value.items():
            out.update(_arrays(v, prefix + key, f"{prefix}{key}."))
        return out
    array = _numeric(value)
    return {} if array is None else {name: ValueArray(array)}


def _numeric(value: Any) -> np.ndarray | None:
    """``value`` as an array of bools, ``int64`` or ``float64``; ``None`` when it is not one
    (a string, ``null``, a ragged list, an integer beyond ``int64``)."""
    if not isinstance(value, bool | int | float | list):
        return None
    try:
        array = np.asarray(value)
    except ValueError:  # a ragged list
        return None
    kinds = {"b": np.bool_, "i": np.int64, "f": np.float64}
    dtype = kinds.get(array.dtype.kind)
    return None if dtype is None else array.astype(dtype, copy=False)

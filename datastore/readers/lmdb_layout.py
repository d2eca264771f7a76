"""The ``lmdb`` table of a spec: how the records of an LMDB written by other tools are read.

An LMDB written by ``write_lmdb`` describes itself (``lmdb_format``). Any other LMDB holds one
record per sample, and a spec says how it is encoded (``value``):

- ``"raw"``: the bytes of one array in C order; the spec gives its ``dtype`` and ``shape``.
- ``"npy"``: one array as ``np.save`` writes it; dtype and shape come from its header.
- ``"msgpack"``: a map (or an array) packed by ``msgpack``. Each field is one item of it: bytes
  (with ``dtype`` and ``shape`` from the spec or from other items, ``dtype_item`` and
  ``shape_item``), an array map as ``msgpack-numpy`` packs it, or a number or list of numbers.
- ``"pickle"``: a pickled dict, tuple or list; items as for msgpack, numpy arrays included.
  Unpickling runs whatever code the writer of the data chose, so it needs ``allow_pickle``.

The records are those of the environment's main database, or of the named database ``db``
(tools that keep ``train`` and ``val`` in one environment). The samples are the records under
every key but ``skip_keys``, in ``keys`` order: ``"sorted"``
(LMDB's byte order: right for zero-padded indices such as ``b"00000042"``) or ``"numeric"``
(every key a decimal integer, in integer order: ``b"2"`` before ``b"10"``).

In a spec file (TOML; JSON has the same keys)::

    [lmdb]
    value = "msgpack"
    db = "train"             # a named database; default: the main one
    keys = "numeric"
    skip_keys = ["__len__"]
    [lmdb.fields.image]
    item = "data"            # the record's item; default: the field's name
    dtype_item = "dtype"     # or dtype = "<f4"
    shape_item = "shape"     # or shape = [1, 32, 32, 32]
    [lmdb.fields.label]
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from datastore.readers.base import DatasetError

__all__ = ["KEY_ORDERS", "PICKLE_REFUSED", "VALUES", "LmdbLayout", "RecordField"]

VALUES = ("raw", "npy", "msgpack", "pickle")
KEY_ORDERS = ("sorted", "numeric")
NPY_FIELD = "data"  # the field of an npy LMDB whose spec names none
PICKLE_REFUSED = (
    'value = "pickle" is refused: unpickling a record runs code that whoever wrote the LMDB '
    "chose. Set allow_pickle = true in the spec's lmdb table only for data you trust"
)
_FIELD_KEYS = ("item", "dtype", "shape", "dtype_item", "shape_item")
_LAYOUT_KEYS = ("value", "keys", "skip_keys", "allow_pickle", "fields", "db")


def _item_name(value: Any, key: str) -> str | int | None:
    if value is None or (isinstance(value, str) and value):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise DatasetError(
        None, f"{key} must be a map key (a string) or a position (an int >= 0): {value!r}"
    )


@dataclass(frozen=True)
class RecordField:
    """Where one field lies in a record, and its dtype and per-sample shape.

    Args:
        item: msgpack, pickle: the record's item that holds the field, a map key or a position
            in a sequence. Default: ``None``, the field's name (raw, npy: the whole record).
        dtype: a numpy dtype (``"<f4"``, ``"uint8"``). Default: ``None``, from the data (the
            first record); raw records need it.
        shape: the per-sample shape. Default: ``None``, from the data; raw records need it.
        dtype_item: msgpack, pickle: the item that holds the dtype of a bytes item (a string
            such as ``"float32"``). Default: ``None``.
        shape_item: msgpack, pickle: the item that holds the shape of a bytes item.
            Default: ``None``.
    """

    item: str | int | None = None
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None
    dtype_item: str | int | None = None
    shape_item: str | int | None = None

    def __post_init__(self) -> None:
        for key in ("item", "dtype_item", "shape_item"):
            object.__setattr__(self, key, _item_name(getattr(self, key), key))
        if self.dtype is not None:
            try:
                dtype = np.dtype(self.dtype)
            except (TypeError, ValueError) as exc:
                raise DatasetError(
                    None, f"dtype {self.dtype!r} is not a numpy dtype: {exc}"
                ) from None
            if dtype.hasobject:
                raise DatasetError(None, f"dtype {self.dtype!r} holds Python objects")
            object.__setattr__(self, "dtype", dtype)
        if self.shape is not None:
            shape = self.shape
            try:
                if isinstance(shape, str | bytes) or any(isinstance(n, bool) for n in shape):
                    raise TypeError
                shape = tuple(operator.index(n) for n in shape)
            except TypeError:
                raise DatasetError(None, f"shape must be a list of ints, got {shape!r}") from None
            if any(n < 0 for n in shape):
                raise DatasetError(None, f"shape {list(shape)} has a negative length")
            object.__setattr__(self, "shape", shape)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in _FIELD_KEYS if getattr(self, k) is not None}
        if self.dtype is not None:
            d["dtype"] = self.dtype.str
        if self.shape is not None:
            d["shape"] = list(self.shape)
        return d


@dataclass(frozen=True)
class LmdbLayout:
    """How to read an LMDB not written by ``write_lmdb``: the ``lmdb`` table of a spec.

    Args:
        value: the record encoding, one of ``VALUES``.
        fields: ``{name: RecordField}`` (or ``(name, RecordField)`` pairs), in order; raw and
            npy records hold one field. Default: ``()``, npy only: one field ``"data"``.
        keys: the sample order, one of ``KEY_ORDERS``. Default: ``"sorted"``.
        skip_keys: keys that are not samples (``"__len__"``, ``"__keys__"``). Default: ``()``.
        allow_pickle: ``True`` to read ``value = "pickle"``. Default: ``False``, refused.
        db: the named database that holds the records. Default: ``None``, the main one.

    Raises:
        DatasetError: naming the field and key at fault; for pickle without ``allow_pickle``,
            saying that unpickling runs code.
    """

    value: str
    fields: tuple[tuple[str, RecordField], ...] = ()
    keys: str = "sorted"
    skip_keys: tuple[str, ...] = ()
    allow_pickle: bool = False
    db: str | None = None

    def __post_init__(self) -> None:
        if self.db is not None and not (isinstance(self.db, str) and self.db):
            raise DatasetError(None, f"lmdb db must be a database's name: {self.db!r}")
        if self.value not in VALUES:
            raise DatasetError(None, f"lmdb value {self.value!r} is not one of {', '.join(VALUES)}")
        if self.keys not in KEY_ORDERS:
            raise DatasetError(
                None, f"lmdb keys {self.keys!r} is not one of {', '.join(KEY_ORDERS)}"
            )
        if not isinstance(self.allow_pickle, bool):
            raise DatasetError(None, f"allow_pickle must be true or false: {self.allow_pickle!r}")
        if self.value == "pickle" and not self.allow_pickle:
            raise DatasetError(None, PICKLE_REFUSED)
        skip = self.skip_keys
        if not isinstance(skip, tuple | list) or not all(isinstance(k, str) and k for k in skip):
            raise DatasetError(None, f"skip_keys must be a list of non-empty strings: {skip!r}")
        object.__setattr__(self, "skip_keys", tuple(skip))
        fields = self.fields.items() if isinstance(self.fields, Mapping) else self.fields
        try:
            fields = tuple((name, RecordField() if f is None else f) for name, f in fields)
        except (TypeError, ValueError):
            raise DatasetError(None, f"lmdb fields map names to fields: {self.fields!r}") from None
        if not fields and self.value == "npy":
            fields = ((NPY_FIELD, RecordField()),)
        for name, f in fields:
            if not isinstance(name, str) or not name or not isinstance(f, RecordField):
                raise DatasetError(None, f"lmdb fields map names to RecordField: {name!r}: {f!r}")
        names = [name for name, _ in fields]
        if len(set(names)) != len(names):
            raise DatasetError(None, f"lmdb fields name a field twice: {names}")
        object.__setattr__(self, "fields", fields)
        self._check_fields()

    def _check_fields(self) -> None:
        if not self.fields:
            raise DatasetError(None, f'value = "{self.value}" needs lmdb.fields: what each holds')
        if self.value not in ("raw", "npy"):
            return
        if len(self.fields) != 1:
            raise DatasetError(
                None, f'a "{self.value}" record is one array: name one field in lmdb.fields'
            )
        name, f = self.fields[0]
        used = [k for k in ("item", "dtype_item", "shape_item") if getattr(f, k) is not None]
        if used:
            raise DatasetError(
                None, f'{", ".join(used)}: a "{self.value}" record is one array, not items', name
            )
        if self.value == "raw" and (f.dtype is None or f.shape is None):
            raise DatasetError(None, 'a "raw" record is bare bytes: give dtype and shape', name)

    @classmethod
    def from_dict(cls, d: Any, where: str | None = None) -> LmdbLayout:
        """The layout of a parsed ``lmdb`` table; ``DatasetError`` naming ``where``."""
        try:
            if not isinstance(d, dict):
                raise DatasetError(None, "lmdb must be a table/object")
            unknown = sorted(set(d) - set(_LAYOUT_KEYS))
            if unknown:
                raise DatasetError(
                    None, f"unknown key(s) {unknown} in lmdb ({', '.join(_LAYOUT_KEYS)})"
                )
            if "value" not in d:
                raise DatasetError(None, f"lmdb needs value, one of {', '.join(VALUES)}")
            raw_fields = d.get("fields", {})
            if not isinstance(raw_fields, dict):
                raise DatasetError(None, "lmdb.fields must be a table/object of fields")
            fields = []
            for name, f in raw_fields.items():
                if not isinstance(f, dict):
                    raise DatasetError(None, "lmdb.fields.NAME must be a table/object", name)
                bad = sorted(set(f) - set(_FIELD_KEYS))
                if bad:
                    raise DatasetError(
                        None,
                        f"unknown key(s) {bad} in lmdb.fields ({', '.join(_FIELD_KEYS)})",
                        name,
                    )
                try:
                    fields.append((name, RecordField(**f)))
                except DatasetError as exc:
                    raise DatasetError(None, exc.reason, name) from None
            skip = d.get("skip_keys", ())
            return cls(
                d["value"],
                tuple(fields),
                d.get("keys", "sorted"),
                tuple(skip) if isinstance(skip, list) else skip,
                d.get("allow_pickle", False),
                d.get("db"),
            )
        except DatasetError as exc:
            raise DatasetError(where, exc.reason, exc.field) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "keys": self.keys,
            "skip_keys": list(self.skip_keys),
            "allow_pickle": self.allow_pickle,
            "fields": {name: f.to_dict() for name, f in self.fields},
            **({"db": self.db} if self.db is not None else {}),
        }

"""The samples of an LMDB read through a spec's ``lmdb`` table (``lmdb_layout``): the sample
keys in order, and each field's array out of a record.

``SpecRecords`` is built once from a read transaction (every key is listed, the first record is
decoded to learn what the spec leaves to the data) and pickles as plain data. Every record read
later is checked against the first: the same dtype and shape for every field, or a
``DatasetError`` naming the LMDB, the field and the record's key.
"""

from __future__ import annotations

import pickle
from typing import Any

import lmdb
import msgpack
import numpy as np

from datastore.readers.base import DatasetError, FieldInfo, default_spatial_axes
from datastore.readers.lmdb_layout import LmdbLayout, RecordField
from datastore.readers.npyfile import npy_in_buffer

__all__ = ["KeyTable", "SpecRecords"]


class KeyTable:
    """Sample keys in order, packed: key ``i`` is ``blob[offsets[i]:offsets[i + 1]]`` (about 8
    bytes a key besides the keys themselves, where a list of ``bytes`` takes some 40)."""

    def __init__(self, keys: list[bytes]):
        self.blob = b"".join(keys)
        self.offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum([len(k) for k in keys], out=self.offsets[1:])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        return self.blob[self.offsets[i] : self.offsets[i + 1]]


def list_keys(txn: lmdb.Transaction, layout: LmdbLayout, where: str) -> KeyTable:
    """The sample keys of the environment, in ``layout.keys`` order, ``skip_keys`` left out."""
    skip = {k.encode("utf-8") for k in layout.skip_keys}
    keys = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
    keys = [k for k in keys if k not in skip]
    if not keys:
        raise DatasetError(where, "holds no sample records (skip_keys aside)")
    if layout.keys == "numeric":
        keys = _numeric_order(keys, where)
    return KeyTable(keys)


def _numeric_order(keys: list[bytes], where: str) -> list[bytes]:
    seen: dict[int, bytes] = {}
    for k in keys:
        if not (k.isdigit() and k.isascii()):
            raise DatasetError(
                where,
                f'key {k!r} is not a decimal integer (keys = "numeric"); name the keys that '
                "are not samples in skip_keys",
            )
        other = seen.setdefault(int(k), k)
        if other is not k:
            raise DatasetError(where, f"keys {other!r} and {k!r} are the same number")
    return [seen[n] for n in sorted(seen)]


def _spellings(item: str | int) -> tuple[Any, ...]:
    """A map key as the writer may have stored it: msgpack read raw gives ``bytes`` keys."""
    return (item, item.encode("utf-8")) if isinstance(item, str) else (item,)


def _shown(k: Any) -> str:
    return repr(k.decode("utf-8", "replace") if isinstance(k, bytes) else k)


class SpecRecords:
    """The samples of one LMDB as its spec's ``lmdb`` table describes them.

    Attributes:
        layout: the ``LmdbLayout``.
        keys: the sample keys, in order (``KeyTable``).
        fields: ``{name: FieldInfo}``, every field the layout names, default spatial axes.
    """

    def __init__(self, layout: LmdbLayout, txn: lmdb.Transaction, where: str):
        self.layout, self.where = layout, where
        self._record_fields = dict(layout.fields)
        self.keys = list_keys(txn, layout, where)
        key = self.keys[0]
        record = self._decode(txn.get(key), key)
        self.fields: dict[str, FieldInfo] = {}
        self._origin: dict[str, str] = {}
        for name, rf in layout.fields:
            arr = self._extract(record, name, rf, key)
            given = [k for k in ("dtype", "shape") if getattr(rf, k) is not None]
            self._origin[name] = (
                f"the spec (lmdb.fields.{name}: {', '.join(given)})"
                if given
                else f"the first record {key!r}"
            )
            shape = arr.shape if rf.shape is None else rf.shape
            info = FieldInfo(name, arr.dtype if rf.dtype is None else rf.dtype, shape)
            self._check(arr, info, key)
            self.fields[name] = FieldInfo(name, info.dtype, shape, default_spatial_axes(len(shape)))

    def __len__(self) -> int:
        return len(self.keys)

    def array(self, buf: Any, info: FieldInfo, key: bytes) -> np.ndarray:
        """Field ``info`` of the record ``buf`` under ``key``: a view of ``buf`` (raw, npy)
        or a decoded array, of exactly the field's dtype and shape."""
        rf = self._record_fields[info.name]
        arr = self._extract(self._decode(buf, key), info.name, rf, key)
        self._check(arr, info, key)
        return arr

    def check_all(self, txn: lmdb.Transaction) -> None:
        """Every raw record's size and every npy record's header (cheap: no data is read);
        msgpack and pickle records are checked as they are read."""
        if self.layout.value not in ("raw", "npy"):
            return
        info = next(iter(self.fields.values()))
        for i in range(len(self.keys)):
            key = self.keys[i]
            self.array(self._get(txn, key, info.name), info, key)

    def _get(self, txn: lmdb.Transaction, key: bytes, field: str) -> Any:
        buf = txn.get(key)
        if buf is None:
            raise DatasetError(self.where, f"no record under key {key!r}", field)
        return buf

    # -- decoding -------------------------------------------------------------------------------
    def _decode(self, buf: Any, key: bytes) -> Any:
        """The record: raw: ``buf``; npy: its array; msgpack, pickle: the unpacked object."""
        value = self.layout.value
        if value == "raw":
            return buf
        try:
            if value == "npy":
                return npy_in_buffer(buf)
            if value == "msgpack":
                return msgpack.unpackb(buf, raw=True, strict_map_key=False)
            return pickle.loads(buf)
        except Exception as exc:  # foreign bytes: any decoder error means the same
            raise DatasetError(
                self.where, f"record {key!r} is not {value}: {type(exc).__name__}: {exc}"
            ) from None

    def _extract(self, record: Any, name: str, rf: RecordField, key: bytes) -> np.ndarray:
        """The field's value in ``record`` as an array (not yet checked against the field)."""
        if self.layout.value == "npy":
            return record
        if self.layout.value == "raw":
            return self._from_bytes(record, rf.dtype, rf.shape, name, key, "the record")
        item = name if rf.item is None else rf.item
        value = self._item(record, item, name, key)
        what = f"item {_shown(item)}"
        if isinstance(value, dict) and self._numpy_map(value):
            return self._from_numpy_map(value, name, key, what)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise DatasetError(self.where, f"record {key!r}: {what} holds objects", name)
            return value
        if isinstance(value, bytes | bytearray | memoryview):
            dtype = rf.dtype if rf.dtype_item is None else self._dtype_at(record, rf, name, key)
            shape = rf.shape if rf.shape_item is None else self._shape_at(record, rf, name, key)
            return self._from_bytes(value, dtype, shape, name, key, what)
        if isinstance(value, bool | int | float | list | tuple | np.generic):
            try:
                arr = np.asarray(value)
            except ValueError as exc:  # a ragged list
                raise DatasetError(self.where, f"record {key!r}: {what}: {exc}", name) from None
            if arr.dtype.kind in "biufc":
                return arr if rf.dtype is None else self._cast(arr, rf.dtype, name, key, what)
        raise DatasetError(
            self.where,
            f"record {key!r}: {what} is a {type(value).__name__}, not an array, bytes, a number "
            "or a list of numbers",
            name,
        )

    def _cast(
        self, arr: np.ndarray, dtype: np.dtype, name: str, key: bytes, what: str
    ) -> np.ndarray:
        """Numbers as the spec's dtype: ints to any width that holds them, floats to floats;
        never a float to an int, nor an int that does not fit."""
        if np.can_cast(arr.dtype, dtype, "same_kind"):
            cast = arr.astype(dtype)
            if dtype.kind not in "biu" or np.array_equal(cast, arr):
                return cast
        raise DatasetError(
            self.where, f"record {key!r}: {what} is {arr.tolist()!r}, not a {dtype.str}", name
        )

    def _item(self, record: Any, item: str | int, name: str, key: bytes) -> Any:
        if isinstance(record, dict):
            for k in _spellings(item):
                if k in record:
                    return record[k]
            have = ", ".join(_shown(k) for k in record)
            raise DatasetError(
                self.where, f"record {key!r} has no item {_shown(item)} (it has: {have})", name
            )
        if isinstance(record, list | tuple):
            if isinstance(item, int) and item < len(record):
                return record[item]
            raise DatasetError(
                self.where,
                f"record {key!r} is a sequence of {len(record)} items: item must be a position "
                f"0..{len(record) - 1}, got {_shown(item)}",
                name,
            )
        raise DatasetError(
            self.where, f"record {key!r} is a {type(record).__name__}, not a map or sequence", name
        )

    def _dtype_at(self, record: Any, rf: RecordField, name: str, key: bytes) -> np.dtype:
        value = self._item(record, rf.dtype_item, name, key)
        try:
            return np.dtype(value.decode("ascii") if isinstance(value, bytes) else value)
        except (TypeError, ValueError, UnicodeDecodeError):
            raise DatasetError(
                self.where,
                f"record {key!r}: item {_shown(rf.dtype_item)} (dtype_item) is {value!r}, "
                "not a numpy dtype",
                name,
            ) from None

    def _shape_at(self, record: Any, rf: RecordField, name: str, key: bytes) -> tuple[int, ...]:
        value = self._item(record, rf.shape_item, name, key)
        if isinstance(value, list | tuple) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
        ):
            return tuple(value)
        raise DatasetError(
            self.where,
            f"record {key!r}: item {_shown(rf.shape_item)} (shape_item) is {value!r}, "
            "not a list of lengths",
            name,
        )

    @staticmethod
    def _numpy_map(value: dict) -> bool:
        """An array as ``msgpack-numpy`` packs it: ``{nd: True, type, shape, data}``."""
        return any(value.get(k) is True for k in _spellings("nd"))

    def _from_numpy_map(self, value: dict, name: str, key: bytes, what: str) -> np.ndarray:
        def get(k: str) -> Any:
            return next((value[s] for s in _spellings(k) if s in value), None)

        typ, shape = get("type"), get("shape")
        try:
            dtype = np.dtype(typ.decode("ascii") if isinstance(typ, bytes) else typ)
            shape = tuple(int(n) for n in shape)
        except (TypeError, ValueError, UnicodeDecodeError):
            raise DatasetError(
                self.where,
                f"record {key!r}: {what} is an array map of type {typ!r}, "
                f"shape {shape!r}: not a dtype and a shape",
                name,
            ) from None
        return self._from_bytes(get("data"), dtype, shape, name, key, what)

    def _from_bytes(
        self,
        data: Any,
        dtype: np.dtype | None,
        shape: tuple[int, ...] | None,
        name: str,
        key: bytes,
        what: str,
    ) -> np.ndarray:
        if dtype is None or shape is None:
            raise DatasetError(
                self.where,
                f"record {key!r}: {what} is bytes; give lmdb.fields.{name} a dtype and a shape "
                "(or dtype_item and shape_item: the items that hold them)",
                name,
            )
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DatasetError(
                self.where, f"record {key!r}: {what} holds a {type(data).__name__}, not bytes", name
            )
        need = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if len(data) != need:
            raise DatasetError(
                self.where,
                f"record {key!r}: {what} holds {len(data)} bytes, dtype {dtype.str} and shape "
                f"{list(shape)} make {need}; check lmdb.fields.{name} (dtype, shape)",
                name,
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape)

    def _check(self, arr: np.ndarray, info: FieldInfo, key: bytes) -> None:
        if arr.dtype == info.dtype and arr.shape == info.shape:
            return
        raise DatasetError(
            self.where,
            f"record {key!r} holds {arr.dtype.str} {list(arr.shape)}, but "
            f"{self._origin[info.name]} says {info.dtype.str} {list(info.shape)}",
            info.name,
        )

"""The LMDB record encoding of a dataset, and ``write_lmdb``.

An LMDB environment (a directory holding ``data.mdb``) holds:

- key ``b"__meta__"``: UTF-8 JSON, written last (so a reader never sees a half-written dataset)::

      {"version": 1,
       "num_samples": N,
       "fields": {NAME: {"dtype": "<f4",            # numpy dtype.str, byte order included
                         "shape": [4, 16, 16, 16],  # per sample
                         "spatial_axes": [1, 2, 3],
                         "codec": null}}}           # or a numcodecs config dict

- key ``b"%08d/%s" % (index, NAME)`` (e.g. ``b"00000042/x"``; indices of 10**8 and more take
  more digits) for each sample ``0 <= index < N`` and field: the field's array as raw bytes in C
  order, or those bytes encoded by the field's codec (``numcodecs.get_codec(config)``), e.g.
  ``{"id": "blosc", "cname": "lz4", ...}`` or ``{"id": "zstd", "level": 3, ...}``.

A record is one value, so reading part of a sample reads the whole record: for uncompressed
records that is a slice of LMDB's memory map (only the pages the region touches are read); a
compressed record is decoded whole, then the region is copied out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import lmdb
import numcodecs
import numpy as np
from numcodecs.abc import Codec

from datastore.readers.base import DatasetError, default_spatial_axes

__all__ = ["META_KEY", "VERSION", "FieldMeta", "parse_meta", "sample_key", "write_lmdb"]

META_KEY = b"__meta__"
VERSION = 1


def sample_key(index: int, field: str) -> bytes:
    """The key of ``field`` of sample ``index``: ``b"%08d/" % index + field``."""
    return b"%08d/" % index + field.encode("utf-8")


@dataclass(frozen=True)
class FieldMeta:
    """One field as the metadata record describes it."""

    dtype: np.dtype
    shape: tuple[int, ...]
    spatial_axes: tuple[int, ...]
    codec: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype.str,
            "shape": list(self.shape),
            "spatial_axes": list(self.spatial_axes),
            "codec": self.codec,
        }


def parse_meta(raw: bytes | None, path: str) -> tuple[int, dict[str, FieldMeta]]:
    """``(num_samples, {name: FieldMeta})`` from the ``__meta__`` record; ``DatasetError``
    naming ``path`` (and the field) for a missing or malformed record."""
    if raw is None:
        raise DatasetError(
            path,
            "no __meta__ record: not a dataset written by write_lmdb; describe its records in "
            "a spec file with an lmdb table (docs/loader.md, Spec files)",
        )
    try:
        meta = json.loads(bytes(raw))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DatasetError(path, f"__meta__ record is not JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("version") != VERSION:
        version = meta.get("version") if isinstance(meta, dict) else None
        raise DatasetError(path, f"__meta__ record version {version!r}, expected {VERSION}")
    n, fields = meta.get("num_samples"), meta.get("fields")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or not isinstance(fields, dict):
        raise DatasetError(path, "__meta__ record needs num_samples >= 0 and a fields object")
    out = {}
    for name, f in fields.items():
        try:
            dtype = np.dtype(f["dtype"])
            shape = tuple(int(x) for x in f["shape"])
            axes = tuple(int(a) for a in f.get("spatial_axes", ()))
            codec = f.get("codec")
            if codec is not None:
                numcodecs.get_codec(dict(codec))  # unknown codec ids fail here, not mid-epoch
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(path, f"bad __meta__ entry {f!r}: {exc}", name) from None
        if dtype.hasobject or any(s < 0 for s in shape) or any(a >= len(shape) for a in axes):
            raise DatasetError(path, f"bad __meta__ entry {f!r}", name)
        out[name] = FieldMeta(dtype, shape, axes, codec)
    return n, out


def _codec_for(codec: Codec | Mapping[str, Codec | None] | None, name: str) -> Codec | None:
    if isinstance(codec, Mapping):
        return codec.get(name)
    return codec


def write_lmdb(
    path: str | os.PathLike,
    samples: Iterable[Mapping[str, np.ndarray]],
    codec: Codec | Mapping[str, Codec | None] | None = None,
    *,
    spatial_axes: Mapping[str, tuple[int, ...]] | None = None,
    batch: int = 64,
) -> int:
    """Write ``samples`` (dicts of arrays, the same fields, dtypes and shapes in each) as a new
    LMDB dataset in directory ``path``. Returns the number of samples.

    Args:
        path: the directory; created if missing; must not already hold ``data.mdb``.
        samples: an iterable of ``{field: array}``; the first one fixes fields, dtypes, shapes
            (stored in this machine's byte order: a big-endian array is converted).
        codec: a numcodecs codec for every field, or ``{field: codec or None}``.
            Default: ``None``, raw bytes.
        spatial_axes: ``{field: axes}`` to record. Default: ``None``, the last three axes of
            arrays with three or more axes.
        batch: samples per write transaction. Default: ``64``.

    Raises:
        DatasetError: a sample whose fields, dtypes or shapes differ from the first, or none.
        FileExistsError: ``path`` already holds an LMDB environment.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, "data.mdb")):
        raise FileExistsError(f"{path}: already holds an LMDB environment (data.mdb)")
    env = lmdb.open(path, map_size=64 << 20, subdir=True, meminit=False)
    try:
        fields: dict[str, FieldMeta] | None = None
        pending: list[tuple[bytes, bytes]] = []
        n = 0
        for sample in samples:
            if fields is None:
                fields = _fields_of(path, sample, codec, spatial_axes)
                codecs = {k: _codec_for(codec, k) for k in fields}
            _check_sample(path, n, sample, fields)
            for name in fields:
                arr = np.ascontiguousarray(sample[name], dtype=fields[name].dtype)
                c = codecs[name]
                data = arr.tobytes() if c is None else bytes(c.encode(arr))
                pending.append((sample_key(n, name), data))
            n += 1
            if n % batch == 0:
                _put(env, pending)
                pending.clear()
        if fields is None:
            raise DatasetError(path, "no samples to write")
        meta = {
            "version": VERSION,
            "num_samples": n,
            "fields": {k: f.to_json() for k, f in fields.items()},
        }
        pending.append((META_KEY, json.dumps(meta).encode("utf-8")))
        _put(env, pending)
        env.sync(True)
    finally:
        env.close()
    return n


def _fields_of(
    path: str,
    sample: Mapping[str, np.ndarray],
    codec: Codec | Mapping[str, Codec | None] | None,
    spatial_axes: Mapping[str, tuple[int, ...]] | None,
) -> dict[str, FieldMeta]:
    if not isinstance(sample, Mapping) or not sample:
        raise DatasetError(path, "sample 0 must be a non-empty dict of arrays")
    fields = {}
    for name, value in sample.items():
        if not isinstance(name, str) or not name:
            raise DatasetError(path, f"field names are non-empty strings, got {name!r}")
        arr = np.asarray(value)
        if arr.dtype.hasobject:
            raise DatasetError(path, "object arrays cannot be stored", name)
        native = arr.dtype.newbyteorder("=")  # the loader delivers this machine's byte order
        axes = (
            tuple(spatial_axes[name])
            if spatial_axes is not None and name in spatial_axes
            else default_spatial_axes(arr.ndim)
        )
        c = _codec_for(codec, name)
        fields[name] = FieldMeta(native, arr.shape, axes, None if c is None else c.get_config())
    return fields


def _check_sample(
    path: str, index: int, sample: Mapping[str, np.ndarray], fields: dict[str, FieldMeta]
) -> None:
    if not isinstance(sample, Mapping) or set(sample) != set(fields):
        got = sorted(sample) if isinstance(sample, Mapping) else type(sample).__name__
        raise DatasetError(path, f"sample {index} has fields {got}, expected {sorted(fields)}")
    for name, f in fields.items():
        arr = np.asarray(sample[name])
        if arr.dtype.newbyteorder("=") != f.dtype or arr.shape != f.shape:
            raise DatasetError(
                path,
                f"sample {index} is {arr.dtype.str} {arr.shape}, sample 0 was "
                f"{f.dtype.str} {f.shape}",
                name,
            )


def _put(env: lmdb.Environment, items: list[tuple[bytes, bytes]]) -> None:
    """Write ``items`` in one transaction, doubling the map size until they fit."""
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in items:
                    txn.put(key, value)
            return
        except lmdb.MapFullError:
            env.set_mapsize(env.info()["map_size"] * 2)

"""Dataset readers: HDF5, zarr, LMDB, ``.npy``/``.npz`` files and tar shards behind one interface.

::

    from datastore.readers import open_dataset

    with open_dataset("/l/ssd/cosmo/train.h5") as ds:  # or a DatasetSpec, or a spec file
        ds.fields["x"]             # FieldInfo(name, dtype, shape, spatial_axes, chunks)
        block = ds.read(7, "x", (slice(None), slice(0, 64), slice(64, 128), slice(0, 128)))

Every bad input raises ``DatasetError`` (a ``ValueError``) naming the file and the field.

A format is a reader module that registers its ``Format`` (``registry``: name, reader,
suffixes, detection) and is imported by ``spec``; ``FORMATS`` holds every registered one.

The names below load on first use (PEP 562), so that ``datastore stage``, whose command line
registers ``datastore inspect`` from this package, does not pay for numpy, h5py and zarr.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datastore.readers.base import DatasetError, FieldInfo, Reader
    from datastore.readers.lmdb_format import write_lmdb
    from datastore.readers.lmdb_layout import LmdbLayout, RecordField
    from datastore.readers.registry import FORMATS, Format, register
    from datastore.readers.spec import DatasetSpec, FieldSpec, detect, open_dataset

__all__ = [
    "FORMATS",
    "DatasetError",
    "DatasetSpec",
    "FieldInfo",
    "FieldSpec",
    "Format",
    "LmdbLayout",
    "Reader",
    "RecordField",
    "detect",
    "open_dataset",
    "register",
    "write_lmdb",
]

_MODULE_OF = {
    "DatasetError": "base",
    "FieldInfo": "base",
    "Reader": "base",
    "write_lmdb": "lmdb_format",
    "LmdbLayout": "lmdb_layout",
    "RecordField": "lmdb_layout",
    "FORMATS": "spec",  # through spec: the built-in formats registered
    "Format": "registry",
    "register": "registry",
    "DatasetSpec": "spec",
    "FieldSpec": "spec",
    "detect": "spec",
    "open_dataset": "spec",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

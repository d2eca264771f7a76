"""``open_dataset``: a reader for a spec, a spec file, or a path to detect."""

from __future__ import annotations

import importlib
import os

from datastore.readers.base import DatasetError, Reader
from datastore.readers.spec import SPEC_SUFFIXES, DatasetSpec, detect

__all__ = ["READERS", "open_dataset", "reader_class"]

# format -> (module, class); a backend's library (h5py, zarr, lmdb) loads when first opened
READERS: dict[str, tuple[str, str]] = {
    "hdf5": ("datastore.readers.hdf5_reader", "Hdf5Reader"),
    "hdf5-per-sample": ("datastore.readers.hdf5_reader", "Hdf5PerSampleReader"),
    "zarr": ("datastore.readers.zarr_reader", "ZarrReader"),
    "lmdb": ("datastore.readers.lmdb_reader", "LmdbReader"),
    "npy": ("datastore.readers.npy_reader", "NpyReader"),
    "tar": ("datastore.readers.tar_reader", "TarReader"),
}


def reader_class(fmt: str) -> type[Reader]:
    """The ``Reader`` subclass for format ``fmt`` (one of ``spec.FORMATS``)."""
    module, name = READERS[fmt]
    return getattr(importlib.import_module(module), name)


def open_dataset(
    spec_or_path: DatasetSpec | str | os.PathLike,
    *,
    allow_pickle: bool = True,
    layout: str | None = None,
) -> Reader:
    """A reader for a ``DatasetSpec``; for a path: a spec file (``.json``/``.toml``) is loaded,
    anything else is detected (``detect``).

    Args:
        spec_or_path: the dataset.
        allow_pickle: ``False`` refuses pickled LMDB records even when the spec allows them
            (``datastore serve``: a client's spec file must not run code in the service).
            Default: ``True``, as the spec says.
        layout: for a path of HDF5 files: ``"shards"`` or ``"per-sample"`` (``detect``);
            a spec states it in its format. Default: ``None``, decided from the files.

    Raises:
        DatasetError: naming the file (and field) for any input that cannot be read as asked.
    """
    if isinstance(spec_or_path, DatasetSpec):
        spec = spec_or_path
        _no_layout(layout, spec.paths[0], spec.format)
    elif isinstance(spec_or_path, str | os.PathLike):
        path = os.fspath(spec_or_path)
        if path.lower().endswith(SPEC_SUFFIXES):
            spec = DatasetSpec.load(path)
            _no_layout(layout, path, spec.format)
        else:
            spec = detect(path, layout)
    else:
        raise DatasetError(None, f"expected a DatasetSpec or a path, got {spec_or_path!r}")
    if not allow_pickle and spec.lmdb is not None and spec.lmdb.value == "pickle":
        where = spec.paths[0] if isinstance(spec_or_path, DatasetSpec) else spec_or_path
        raise DatasetError(
            where,
            'value = "pickle" is refused here: datastore serve unpickles nothing a client names '
            "(it would run code that the data chose); read it with the embedded loader, or "
            "convert it once with write_lmdb (docs/loader.md)",
        )
    return reader_class(spec.format)(spec)


def _no_layout(layout: str | None, where: str, fmt: str) -> None:
    """A spec states its layout in its format: a ``layout`` beside it is refused."""
    if layout is not None:
        raise DatasetError(
            where, f"layout={layout!r} beside a spec of format {fmt!r}: the format says it"
        )

"""What a dataset is: its format, where it lies, which fields to read; auto-detection, and
``open_dataset``.

Formats (every field has the same dtype and per-sample shape in every sample), each declared by
its reader module in the ``registry`` (a new format: a reader module that registers its
``Format``, imported below):

- ``hdf5``: one or more HDF5 files (shards such as ``part-000.h5``, ``part-001.h5``, each
  holding any number of samples, concatenated in path order), one dataset per field with a
  leading sample axis. Nested datasets are fields named by their path (``"grp/x"``).
- ``hdf5-per-sample``: one HDF5 file per sample (CosmoFlow style); each file holds every field
  as a dataset without a sample axis. Detection tells a set of shards from a set of samples
  by the files' shapes (the rules: ``hdf5_reader.set_format``).
- ``zarr``: a zarr group (format 2 or 3), one array per field with a leading sample axis.
- ``lmdb``: an LMDB environment written by ``write_lmdb`` (``lmdb_format`` documents records),
  or any LMDB whose records the spec's ``lmdb`` table describes (``lmdb_layout``: raw bytes,
  ``.npy`` bytes, msgpack, or pickle with ``allow_pickle``); a directory holding ``data.mdb``
  or one file (an environment written with ``subdir=False``).
- ``npy``: ``.npy`` files, one per sample, holding the one field the spec names (``"data"`` when
  it names none); or ``.npz`` files, one per sample, whose keys are the fields.
- ``tar``: uncompressed tar shards whose members sharing a key are one sample (WebDataset's
  layout: ``000123.x.npy``, ``000123.cls``, ``000123.json``; ``tar_reader`` names the fields),
  read at their offsets in the tar without extracting.

Paths may be files, directories (their files with the format's suffixes, sorted by name; names
starting with ``.`` skipped) or globs (matches sorted by name). A spec with no fields selects
every field in the data, with the default spatial axes (the last three of a per-sample array of
three or more axes); a ``FieldSpec`` is taken literally: ``FieldSpec("x")`` is not spatial.

A spec file (``DatasetSpec.load``) is JSON or TOML (docs/loader.md has one for each format)::

    format = "hdf5-per-sample"
    paths = ["cosmo/train"]          # relative to the spec file
    label = "unitPar"
    [[fields]]
    name = "full"
    spatial_axes = [0, 1, 2]         # channels-last (D, H, W, C)
    [[fields]]
    name = "unitPar"
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import stat
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# The built-in readers: importing each registers its formats (``registry``), in this order.
from datastore.readers import hdf5_reader, lmdb_reader, npy_reader, tar_reader, zarr_reader  # noqa: F401
from datastore.readers.base import DatasetError, DatasetMissing, Reader
from datastore.readers.lmdb_layout import LmdbLayout
from datastore.readers.registry import FORMATS, LAYOUTS, detect_format, format_named

__all__ = [
    "FORMATS",
    "SPEC_SUFFIXES",
    "DatasetSpec",
    "FieldSpec",
    "check_layout",
    "detect",
    "open_dataset",
]

SPEC_SUFFIXES = (".json", ".toml")


@dataclass(frozen=True)
class FieldSpec:
    """A field to read and the axes of its per-sample array that are spatial.

    Args:
        name: the field's name in the data.
        spatial_axes: increasing, non-negative axes of the per-sample array, e.g. ``(1, 2, 3)``
            for a ``(C, D, H, W)`` volume. Default: ``()``, not spatial (a label).
    """

    name: str
    spatial_axes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise DatasetError(None, f"field name must be a non-empty string, got {self.name!r}")
        axes = self.spatial_axes
        if isinstance(axes, str | bytes) or not hasattr(axes, "__iter__"):
            raise DatasetError(None, f"spatial_axes must be ints, got {axes!r}", self.name)
        axes = tuple(axes)
        try:
            if any(isinstance(a, bool) for a in axes):
                raise TypeError
            axes = tuple(operator.index(a) for a in axes)
        except TypeError:
            raise DatasetError(
                None, f"spatial_axes must be ints, got {axes!r}", self.name
            ) from None
        if any(a < 0 for a in axes) or any(b <= a for a, b in itertools.pairwise(axes)):
            raise DatasetError(
                None, f"spatial_axes must be increasing and non-negative, got {axes}", self.name
            )
        object.__setattr__(self, "spatial_axes", axes)


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset: its format, its paths, and the fields to read.

    Args:
        format: a name in ``FORMATS`` (the registered formats, ``registry``).
        paths: files, directories or globs (a single string is one path).
        fields: ``FieldSpec`` s (or bare names) to read. Default: ``()``, every field in the data
            with default spatial axes.
        label: the field that is the training target, if any. Default: ``None``.
        lmdb: ``lmdb`` only: how the records of an LMDB not written by ``write_lmdb`` are
            read (an ``LmdbLayout``, or the dict of a spec file's ``lmdb`` table).
            Default: ``None``, the records of ``write_lmdb``.
    """

    format: str
    paths: tuple[str, ...]
    fields: tuple[FieldSpec, ...] = ()
    label: str | None = None
    lmdb: LmdbLayout | None = None

    def __post_init__(self) -> None:
        paths = self.paths
        if isinstance(paths, str | os.PathLike):
            paths = (paths,)
        try:
            paths = tuple(os.fspath(p) for p in paths)
        except TypeError:
            raise DatasetError(None, f"paths must be strings, got {self.paths!r}") from None
        where = paths[0] if paths else None
        if not paths or any(not p for p in paths):
            raise DatasetError(where, "a dataset spec needs at least one non-empty path")
        format_named(self.format, where)
        fields = tuple(FieldSpec(f) if isinstance(f, str) else f for f in self.fields)
        for f in fields:
            if not isinstance(f, FieldSpec):
                raise DatasetError(where, f"fields must be FieldSpec or names, got {f!r}")
        names = [f.name for f in fields]
        for name in names:
            if names.count(name) > 1:
                raise DatasetError(where, "named twice in the spec", name)
        if self.label is not None:
            if not isinstance(self.label, str):
                raise DatasetError(where, f"label must be a field name, got {self.label!r}")
            if fields and self.label not in names:
                raise DatasetError(where, f"label is not among the fields {names}", self.label)
        lmdb = self.lmdb
        if lmdb is not None:
            if self.format != "lmdb":
                raise DatasetError(where, f"an lmdb table is for format lmdb, not {self.format}")
            if isinstance(lmdb, dict):
                lmdb = LmdbLayout.from_dict(lmdb, where)
            if not isinstance(lmdb, LmdbLayout):
                raise DatasetError(where, f"lmdb must be an LmdbLayout or a dict, got {lmdb!r}")
        object.__setattr__(self, "paths", paths)
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "lmdb", lmdb)

    @classmethod
    def from_dict(
        cls, d: Any, base_dir: str | None = None, where: str | None = None
    ) -> DatasetSpec:
        """A spec from a plain dict (a parsed spec file); relative paths join ``base_dir``."""
        if not isinstance(d, dict):
            raise DatasetError(where, "a dataset spec must be a table/object")
        unknown = sorted(set(d) - {"format", "paths", "fields", "label", "lmdb"})
        if unknown:
            raise DatasetError(
                where, f"unknown key(s) {unknown} (format, paths, fields, label, lmdb)"
            )
        if "format" not in d or "paths" not in d:
            raise DatasetError(where, "a dataset spec needs 'format' and 'paths'")
        paths = d["paths"]
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise DatasetError(where, f"'paths' must be a string or a list of strings: {paths!r}")
        if base_dir is not None:
            paths = [p if os.path.isabs(p) else os.path.join(base_dir, p) for p in paths]
        fields = []
        raw_fields = d.get("fields", [])
        if not isinstance(raw_fields, list):
            raise DatasetError(where, "'fields' must be a list")
        for f in raw_fields:
            if isinstance(f, str):
                fields.append(FieldSpec(f))
                continue
            if not isinstance(f, dict) or "name" not in f or set(f) - {"name", "spatial_axes"}:
                raise DatasetError(where, f"a field is a name or {{name, spatial_axes}}, got {f!r}")
            fields.append(FieldSpec(f["name"], tuple(f.get("spatial_axes", ()))))
        lmdb = d.get("lmdb")
        try:
            layout = None if lmdb is None else LmdbLayout.from_dict(lmdb)
            return cls(d["format"], tuple(paths), tuple(fields), d.get("label"), layout)
        except DatasetError as exc:
            raise DatasetError(where, exc.reason, exc.field) from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> DatasetSpec:
        """Read a spec file: ``.json`` or ``.toml`` (see the module docstring)."""
        path = os.fspath(path)
        try:
            raw = _read_regular(path)
        except FileNotFoundError:
            raise DatasetMissing(path, "no such spec file") from None
        except OSError as exc:
            raise DatasetError(path, f"cannot read spec file: {exc.strerror or exc}") from None
        try:
            if path.lower().endswith(".toml"):
                d = tomllib.loads(raw.decode("utf-8"))
            else:
                d = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise DatasetError(path, f"not a valid spec file: {exc}") from None
        return cls.from_dict(d, os.path.dirname(os.path.abspath(path)), path)

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data (``json.dumps`` it to write a spec file)."""
        d = {
            "format": self.format,
            "paths": list(self.paths),
            "fields": [{"name": f.name, "spatial_axes": list(f.spatial_axes)} for f in self.fields],
            "label": self.label,
        }
        if self.lmdb is not None:
            d["lmdb"] = self.lmdb.to_dict()
        return d


def _read_regular(path: str) -> bytes:
    """The bytes of the regular file ``path``: opened non-blocking and checked on the open
    descriptor, so a FIFO (whose open would wait for a writer) or a device is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DatasetError(path, "not a regular file (a FIFO, socket, device or directory)")
        with open(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


def detect(
    path: str | os.PathLike, layout: str | None = None, fields: Sequence[str] = ()
) -> DatasetSpec:
    """The spec of the dataset at ``path``, every field (or those named in ``fields``) with
    its default spatial axes.

    ``.h5``/``.hdf5`` file: ``hdf5``. A directory (or glob) of several ``.h5`` files: shards
    (``hdf5``) when their shapes differ in a leading sample axis, one sample per file
    (``hdf5-per-sample``) when their shapes are identical and their datasets share no leading
    length; files of identical shapes that could be either are decided by an attribute our
    writers set, else refused (``hdf5_reader.set_format``).
    A directory with ``zarr.json`` or ``.zgroup``: ``zarr``; with ``data.mdb``: ``lmdb``
    (fields from its metadata record). ``.npy``/``.npz`` files: ``npy``. ``.tar`` files: ``tar``.
    The data is opened to list the fields, so a malformed dataset raises ``DatasetError`` here.

    Args:
        path: the dataset.
        layout: HDF5 only: ``"shards"`` (``hdf5``: a leading sample axis in each file) or
            ``"per-sample"`` (``hdf5-per-sample``: one sample per file), as stated by the
            user. Default: ``None``, decided from the files.
        fields: the fields to read; the others are neither listed nor checked (e.g. an
            xarray file's coordinate arrays, of other lengths). Default: ``()``, all.
    """
    with _detected(os.fspath(path), layout, fields, None) as reader:
        return reader.spec


def _detected(
    path: str, layout: str | None, fields: Sequence[str], confine: Callable[[str], None] | None
) -> Reader:
    """The reader of the dataset at ``path`` as ``detect`` finds it, whose ``spec`` is the one
    ``detect`` returns. Of every field the data is opened once (each file was opened twice, the
    second time by a reader of the detected spec); of ``fields`` named, again with the spatial
    axes found (the first reader's have none)."""
    fmt = detect_format(path, check_layout(layout, path))
    reader = _built(DatasetSpec(fmt, (path,), tuple(fields)), confine)
    found = tuple(FieldSpec(name, reader.found[name].spatial_axes) for name in reader.fields)
    spec = DatasetSpec(fmt, (path,), found)
    if fields:
        reader.close()
        return _built(spec, confine)
    reader.spec = spec
    return reader


def check_layout(layout: Any, where: str | None) -> str | None:
    """``layout`` if it is ``None`` or one of ``LAYOUTS``, else a ``DatasetError``."""
    if layout is None or layout in LAYOUTS:
        return layout
    raise DatasetError(
        where, f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}"
    )


def open_dataset(
    spec_or_path: DatasetSpec | str | os.PathLike,
    *,
    allow_pickle: bool = True,
    layout: str | None = None,
    fields: Sequence[str] = (),
    confine: Callable[[str], None] | None = None,
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
        fields: for a path detected here: read only these fields (``detect``); a spec names
            its own. Default: ``()``, every field.
        confine: the reader's ``confine``, set before it opens anything (``datastore serve``:
            a virtual dataset's source outside its roots is refused unopened). Default:
            ``None``, none.

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
            return _detected(path, layout, fields, confine)
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
    return _built(spec, confine)


def _built(spec: DatasetSpec, confine: Callable[[str], None] | None) -> Reader:
    """The reader of ``spec`` with ``confine`` set before its ``__init__`` runs (which opens
    the data, and takes the spec alone)."""
    cls = format_named(spec.format).reader
    reader = cls.__new__(cls)
    reader.confine = confine
    reader.__init__(spec)
    return reader


def _no_layout(layout: str | None, where: str, fmt: str) -> None:
    """A spec states its layout in its format: a ``layout`` beside it is refused."""
    if layout is not None:
        raise DatasetError(
            where, f"layout={layout!r} beside a spec of format {fmt!r}: the format says it"
        )

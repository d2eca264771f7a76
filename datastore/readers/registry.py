"""The formats ``datastore`` reads: each reader module declares its ``Format`` and registers it.

A ``Format`` says, in one place, what its reader is, which files are its (a directory is listed
for its ``suffixes``), how a directory that is one dataset is recognised (``marker``), and which
format a set of its files turns out to be (``settle``, ``layouts``). The spec (``DatasetSpec``),
the paths (``resolve_paths``) and detection (``detect_format``) read only this table, so a new
reader is one module that calls ``register`` plus the one line of ``spec`` that imports it::

    register(Format("raw", RawReader, suffixes=(".raw",), title=".raw"))

Readers import this module and ``base``, never each other or ``spec`` (at run time).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from datastore.readers.base import DatasetError, DatasetMissing, Reader

if TYPE_CHECKING:
    from datastore.readers.spec import DatasetSpec

__all__ = [
    "FORMATS",
    "LAYOUTS",
    "Format",
    "detect_format",
    "format_named",
    "register",
    "resolve_paths",
]

LAYOUTS = ("shards", "per-sample")  # how several files hold samples (``detect_format``)


@dataclass(frozen=True)
class Format:
    """One format: its reader and how its datasets are found.

    Args:
        name: the name a spec gives (``format = "hdf5"``).
        reader: the ``Reader`` subclass, built from a ``DatasetSpec``.
        suffixes: lower-case suffixes of its files; a directory of them is listed for them
            (sorted by name, ``.`` files skipped). Default: ``()``, a directory format.
        whole: a dataset is one directory or file (zarr, LMDB), never a list of files.
            Default: ``False``.
        marker: for a directory format, whether a directory is one of its datasets; it may
            raise ``DatasetError`` for a directory that is almost one. Default: ``None``.
        detected: detection picks it for files of its suffixes (``False``: only a spec, or
            another format's ``settle``, names it). Default: ``True``.
        settle: the format (this one, or one it stands for) of a detected set of its files
            and where they lie. Default: ``None``, this one.
        layouts: ``{layout: format}`` for a detected set of its files whose layout the user
            states (``LAYOUTS``). Default: none, and a stated layout is refused.
        refused: ``{suffix: reason}``: files detection names as not readable. Default: none.
        title: its name in messages. Default: ``name``.
    """

    name: str
    reader: type[Reader]
    suffixes: tuple[str, ...] = ()
    whole: bool = False
    marker: Callable[[str], bool] | None = None
    detected: bool = True
    settle: Callable[[list[str], str], str] | None = None
    layouts: Mapping[str, str] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)
    title: str = ""

    def __post_init__(self) -> None:
        if not self.title:
            object.__setattr__(self, "title", self.name)


FORMATS: dict[str, Format] = {}
"""Every registered format by name, in the order registered (``spec`` imports the built-ins)."""


def register(fmt: Format) -> Format:
    """Add ``fmt`` to ``FORMATS``; a reader module calls it once, at import.

    Raises:
        ValueError: a name already registered, or a suffix another detected format claims.
    """
    if fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} is registered already")
    if fmt.detected:
        for other in _detected():
            shared = set(fmt.suffixes) & set(other.suffixes)
            if shared:
                raise ValueError(
                    f"format {fmt.name!r}: suffixes {sorted(shared)} belong to format "
                    f"{other.name!r} already"
                )
    FORMATS[fmt.name] = fmt
    return fmt


def format_named(name: object, where: str | None = None) -> Format:
    """The registered format ``name``.

    Raises:
        DatasetError: naming ``where`` and the known formats, for any other name.
    """
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise DatasetError(where, f"unknown format {name!r} (one of: {', '.join(FORMATS)})")
    return fmt


def _detected() -> list[Format]:
    return [f for f in FORMATS.values() if f.detected]


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _matches(path: str) -> list[str]:
    """The existing paths ``path`` names: itself, or a glob's matches sorted by name; each a
    regular file or a directory (opening a FIFO or a device would block or mislead)."""
    if _is_glob(path):
        found = sorted(glob.glob(path))
        if not found:
            raise DatasetMissing(path, "the glob matches nothing")
    elif not os.path.exists(path):
        raise DatasetMissing(path, "no such file or directory")
    else:
        found = [path]
    for f in found:
        if not (os.path.isfile(f) or os.path.isdir(f)):
            raise DatasetError(f, "not a regular file or directory (a FIFO, socket or device)")
    return found


def _listdir(path: str, suffixes: tuple[str, ...]) -> list[str]:
    """Files in directory ``path`` ending in one of ``suffixes``, sorted by name."""
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        raise DatasetError(path, f"cannot list directory: {exc.strerror or exc}") from None
    return [
        os.path.join(path, n)
        for n in names
        if not n.startswith(".")
        and n.lower().endswith(suffixes)
        and os.path.isfile(os.path.join(path, n))
    ]


def resolve_paths(spec: DatasetSpec) -> list[str]:
    """The files a spec reads, in order (for a ``whole`` format: the one directory or file)."""
    fmt = format_named(spec.format, spec.paths[0])
    out: list[str] = []
    for path in spec.paths:
        for m in _matches(path):
            if fmt.whole or not os.path.isdir(m):
                out.append(m)
                continue
            found = _listdir(m, fmt.suffixes)
            if not found:
                raise DatasetError(m, f"no {'/'.join(fmt.suffixes)} files in the directory")
            out.extend(found)
    if fmt.whole and len(out) != 1:
        raise DatasetError(
            spec.paths[0],
            f"a {fmt.name} dataset is one directory (or LMDB file); the paths name {len(out)}",
        )
    return out


def detect_format(path: str, layout: str | None = None) -> str:
    """The format of the dataset at ``path`` (a file, a directory or a glob): a directory a
    format's ``marker`` recognises, else the one detected format whose suffixes its files
    have, ``settle`` d (or ``layout``, one of ``LAYOUTS``, stated by the user)."""
    found = _matches(path)
    if len(found) == 1 and os.path.isdir(found[0]):
        d = found[0]
        for fmt in FORMATS.values():
            if fmt.marker is not None and fmt.marker(d):
                return fmt.name
        detected = _detected()
        suffixes = tuple(s for f in detected for s in (*f.suffixes, *f.refused))
        files = _listdir(d, suffixes)
        if not files:
            listed = "/".join(s for f in detected for s in f.suffixes)
            marked = " or ".join(f.title for f in FORMATS.values() if f.marker is not None)
            raise DatasetError(
                d,
                f"no dataset here: no {listed} files, no {marked} markers"
                + _subdirectory_hint(d, tuple(s for f in detected for s in f.suffixes)),
            )
        return _format_of_files(d, files, layout)
    if any(os.path.isdir(f) for f in found):
        raise DatasetError(path, f"names {len(found)} paths, some directories; name one dataset")
    return _format_of_files(path, found, layout)


def _subdirectory_hint(path: str, suffixes: tuple[str, ...]) -> str:
    """For a directory with no sample files of its own: the first subdirectory that has some
    (class subfolders, ``data/a/*.npy``), and the glob that names them all; else ``""``."""
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(path)):
            sub = os.path.join(path, name)
            if name.startswith(".") or not os.path.isdir(sub):
                continue
            with contextlib.suppress(DatasetError):
                files = _listdir(sub, suffixes)
                if files:
                    ext = os.path.splitext(files[0])[1]
                    return (
                        f"; subdirectories are not searched, and {sub} holds {ext} files: "
                        f"name a glob of them all, '{os.path.join(path, '*', '*' + ext)}', "
                        "or one subdirectory"
                    )
    return ""


def _format_of_file(path: str) -> Format:
    low = path.lower()
    for fmt in _detected():
        for suffix, reason in fmt.refused.items():
            if low.endswith(suffix):
                raise DatasetError(path, reason)
    for fmt in _detected():
        if low.endswith(fmt.suffixes):
            return fmt
    listed = ", ".join(s for f in _detected() for s in f.suffixes)
    raise DatasetError(path, f"not a dataset file ({listed})")


def _format_of_files(where: str, files: list[str], layout: str | None) -> str:
    kinds = {fmt.name: fmt for fmt in map(_format_of_file, files)}
    if len(kinds) != 1:
        raise DatasetError(where, f"mixes dataset kinds {sorted(kinds)}; write a spec")
    (fmt,) = kinds.values()
    if layout is not None:
        if layout not in fmt.layouts:
            takes = " or ".join(f.title for f in _detected() if f.layouts) or "no"
            raise DatasetError(where, f"layout= is for {takes} files; these are {fmt.name}")
        return fmt.layouts[layout]
    return fmt.name if fmt.settle is None else fmt.settle(files, where)

"""The reader interface: per-sample fields, region reads into caller buffers, and the one error.

A dataset is a sequence of samples; every sample holds the same named fields, each an array of
fixed dtype and per-sample shape. ``Reader.read(index, field, region, out)`` reads one field of
one sample, or one box of it (``region``: one ``slice`` per axis of the per-sample array), into
a fresh array or into the caller's preallocated ``out``. Backends read only the box from storage
(an HDF5 hyperslab, zarr chunks, a memory map of a ``.npy`` file or tar member); the exceptions
are documented by the backend (an LMDB record compressed by a codec, a deflated ``.npz`` member).

Readers are safe to share between threads and between processes: what is pickled is the spec and
the scanned layout, never an open handle; each process opens its own handles on first use (a
forked child notices the new pid and reopens).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from datastore.errors import DatasetNotFound

if TYPE_CHECKING:
    from datastore.readers.spec import DatasetSpec

__all__ = [
    "DatasetError",
    "DatasetMissing",
    "FieldInfo",
    "Reader",
    "default_spatial_axes",
    "normalize_region",
]


class DatasetError(ValueError):
    """Bad input: a missing or malformed file, an unknown field, a spec that does not match the
    data, a region out of range. The message is one line naming the file and the field."""

    def __init__(self, path: str | os.PathLike | None, reason: str, field: str | None = None):
        self.path = None if path is None else os.fspath(path)
        self.reason = " ".join(str(reason).split())  # one line, whatever the library said
        self.field = field
        parts = [p for p in (self.path, None if field is None else f"field {field!r}") if p]
        super().__init__(": ".join([*parts, self.reason]))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason, self.field))


class DatasetMissing(DatasetError, DatasetNotFound):
    """No file at the dataset's path (or a glob that matches nothing): a ``DatasetError`` for
    readers' callers, a ``datastore.errors.DatasetNotFound`` for the loader's users."""


def default_spatial_axes(ndim: int) -> tuple[int, ...]:
    """The last three axes of a per-sample array of ``ndim >= 3`` axes; none below that.

    ``(C, D, H, W)`` -> ``(1, 2, 3)``; ``(D, H, W)`` -> ``(0, 1, 2)``; a label ``(4,)`` -> ``()``.
    Channels-last volumes (CosmoFlow's ``(D, H, W, C)``) need a spec that says ``(0, 1, 2)``.
    """
    return tuple(range(ndim - 3, ndim)) if ndim >= 3 else ()


@dataclass(frozen=True)
class FieldInfo:
    """One field as found in the data.

    Args:
        name: the field's name (an HDF5/zarr path such as ``"grp/x"`` for nested arrays).
        dtype: the stored dtype (byte order included); ``out`` buffers must have exactly it.
        shape: the per-sample shape (no sample axis).
        spatial_axes: the axes of ``shape`` that are spatial. Default: ``()``.
        chunks: the per-sample chunk shape of a chunked store; ``None`` when not chunked.
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    spatial_axes: tuple[int, ...] = ()
    chunks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "spatial_axes", tuple(int(a) for a in self.spatial_axes))
        if self.chunks is not None:
            object.__setattr__(self, "chunks", tuple(int(n) for n in self.chunks))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one sample of this field, uncompressed."""
        return self.dtype.itemsize * math.prod(self.shape)


def normalize_region(region: Any, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """``region`` as one ``slice(start, stop)`` per axis with explicit, in-range bounds.

    ``None`` is the whole array. A ``slice`` bound of ``None`` means the axis' start or end.
    Raises ``ValueError`` (the reason only; the reader adds file and field) for anything else:
    a count of slices other than ``len(shape)``, a non-slice, a step other than 1, a negative
    bound, ``start > stop`` or ``stop > shape[axis]``. Clipping is the caller's job.
    """
    if region is None:
        return tuple(slice(0, n) for n in shape)
    if not isinstance(region, tuple):
        raise ValueError(f"region must be a tuple of slices, got {type(region).__name__}")
    if len(region) != len(shape):
        raise ValueError(
            f"region has {len(region)} slice(s), the per-sample array {shape} has {len(shape)} axes"
        )
    out = []
    for axis, (s, n) in enumerate(zip(region, shape, strict=True)):
        if not isinstance(s, slice):
            raise ValueError(f"region axis {axis}: expected a slice, got {s!r}")
        try:
            start = 0 if s.start is None else operator.index(s.start)
            stop = n if s.stop is None else operator.index(s.stop)
            step = 1 if s.step is None else operator.index(s.step)
        except TypeError:
            raise ValueError(f"region axis {axis}: non-integer bound in {s!r}") from None
        if step != 1:
            raise ValueError(f"region axis {axis}: step {step} (only step 1 is read)")
        if not 0 <= start <= stop <= n:
            raise ValueError(f"region axis {axis}: [{start}, {stop}) is out of range [0, {n}]")
        out.append(slice(start, stop))
    return tuple(out)


class Reader(ABC):
    """Reads fields of samples of one dataset, whole or by region.

    Attributes:
        spec: the ``DatasetSpec`` it was opened from.
        files: the files (or the one directory) the spec's paths resolved to.
        fields: ``{name: FieldInfo}`` of the fields the spec selects, in order.
        found: ``{name: FieldInfo}`` of every field in the data, with the spatial axes the
            data implies (the default's, or what its metadata says).
        stored: ``{name: FieldInfo}`` of the fields whose files hold another byte order than
            this machine's, as stored; ``fields`` and ``found`` give them in this machine's
            order, and reads convert (torch tensors have no byte order of their own).
        reached: the files besides ``files`` that reading the fields opens, as found when the
            dataset was opened (HDF5's external links, external storage, virtual datasets'
            sources; of a set of one sample per file, the first file's).

    Subclasses scan the layout in ``__init__`` (picklable attributes only), open per-process
    handles in ``_open()``, release them in ``_close(handles)``, and fill ``out`` in
    ``_read_into``. Attributes named in ``_transient`` are per-process caches: dropped when
    pickled and rebuilt by ``_init_process``.
    """

    _transient: ClassVar[tuple[str, ...]] = ()
    confine: Callable[[str], None] | None = None
    """Called with each file besides the dataset's own that a read would open (HDF5's
    external links, external storage and virtual datasets' sources: ``reached_files``), before
    it is read; raises to refuse it (``datastore serve``: a file outside ``--allow``).
    Default: none, opened."""

    def __init__(self, spec: DatasetSpec):
        self.spec = spec
        self.files: list[str] = []
        self.fields: dict[str, FieldInfo] = {}
        self.found: dict[str, FieldInfo] = {}
        self.stored: dict[str, FieldInfo] = {}
        self.reached: list[str] = []
        self._length = 0
        self._closed = False
        self._init_process()

    # -- what the dataset is -------------------------------------------------------------
    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def label(self) -> str | None:
        return self.spec.label

    @property
    def location(self) -> str:
        """The dataset for messages: its one file or directory, or the first of several."""
        if not self.files:
            return self.spec.paths[0]
        more = f" (and {len(self.files) - 1} more)" if len(self.files) > 1 else ""
        return self.files[0] + more

    def __len__(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        """Bytes of every field of every sample, uncompressed."""
        return self._length * sum(f.nbytes for f in self.fields.values())

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.format} {self.location!r}: {len(self)} samples, "
            f"fields {list(self.fields)}>"
        )

    # -- reading -------------------------------------------------------------------------
    def read(
        self,
        index: int,
        field: str,
        region: tuple[slice, ...] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Read ``field`` of sample ``index``, or the box ``region`` of it.

        Args:
            index: the sample, ``0 <= index < len(self)``.
            field: a name in ``self.fields``.
            region: one ``slice(start, stop)`` per axis of the per-sample array, step 1, within
                bounds. Default: ``None``, the whole sample.
            out: a C-contiguous, writeable array of exactly the region's shape and the field's
                dtype, filled in place. Default: ``None``, a new array.

        Returns:
            ``out``, or the new array.

        Raises:
            DatasetError: naming the file and the field, for a bad index, field, region or
                ``out``, and for a file that cannot be read.
        """
        info = self.fields.get(field) if isinstance(field, str) else None
        if info is None:
            raise DatasetError(self.location, f"no such field (fields: {self._names()})", field)
        i = self._check_index(index, field)
        try:
            sel = normalize_region(region, info.shape)
        except ValueError as exc:
            raise DatasetError(self._path_of(i), str(exc), field) from None
        shape = tuple(s.stop - s.start for s in sel)
        if out is None:
            out = np.empty(shape, dtype=info.dtype)
        else:
            self._check_out(out, shape, info, i)
        if out.size == 0:
            return out
        if self._closed:
            raise DatasetError(self.location, "read from a closed reader", field)
        stored = self.stored.get(field)
        try:
            if stored is None:
                self._read_into(i, info, sel, out)
            else:  # the file's bytes, then swapped in place into this machine's order
                self._read_into(i, stored, sel, out.view(stored.dtype))
                out.byteswap(inplace=True)
        except DatasetError:
            raise
        except (OSError, ValueError, KeyError, RuntimeError, EOFError) as exc:
            raise DatasetError(
                self._path_of(i), f"cannot read sample {i}: {type(exc).__name__}: {exc}", field
            ) from exc
        return out

    def check_files(self) -> None:  # noqa: B027 - a default: nothing more to look at
        """Look into every file of the dataset (``datastore inspect`` does): a reader that
        checks only the first file when opened (one HDF5 file per sample) checks the rest here.
        Default: nothing (``hdf5`` shards are all checked when opened).

        Raises:
            DatasetError: naming the first file that does not hold the fields as expected.
        """

    def stored_dtype(self, name: str) -> np.dtype:
        """Field ``name``'s dtype as its files hold it, the byte order too (``inspect``)."""
        return self.stored.get(name, self.fields[name]).dtype

    def read_sample(self, index: int) -> dict[str, np.ndarray]:
        """Every field of sample ``index``, whole."""
        return {name: self.read(index, name) for name in self.fields}

    def _names(self) -> str:
        return ", ".join(self.fields) or "none"

    def _as_stored(self) -> dict[str, FieldInfo]:
        """``fields`` as their files hold them (the byte order), to check files against."""
        return {name: self.stored.get(name, info) for name, info in self.fields.items()}

    def _check_index(self, index: Any, field: str) -> int:
        try:
            i = operator.index(index)
        except TypeError:
            raise DatasetError(
                self.location, f"sample index must be an integer, got {index!r}", field
            ) from None
        if not 0 <= i < self._length:
            raise DatasetError(
                self.location, f"sample index {i} out of range [0, {self._length})", field
            )
        return i

    def _check_out(self, out: Any, shape: tuple[int, ...], info: FieldInfo, index: int) -> None:
        where = self._path_of(index)
        if not isinstance(out, np.ndarray):
            raise DatasetError(
                where, f"out must be a numpy array, got {type(out).__name__}", info.name
            )
        problems = []
        if out.shape != shape:
            problems.append(f"shape {out.shape} != region shape {shape}")
        if out.dtype != info.dtype:
            problems.append(f"dtype {out.dtype.str} != field dtype {info.dtype.str}")
        if not out.flags.c_contiguous:
            problems.append("not C-contiguous")
        if not out.flags.writeable:
            problems.append("not writeable")
        if problems:
            raise DatasetError(where, "out buffer: " + "; ".join(problems), info.name)

    # -- handles, per process ------------------------------------------------------------
    def _init_process(self) -> None:
        self._lock = threading.RLock()
        self._lock_pid = os.getpid()
        self._state: tuple[int, Any] | None = None

    def _process_lock(self) -> threading.RLock:
        """The reader's lock in this process: a forked child gets a new one (and fresh caches),
        since a thread of the parent may have held the old one at the fork."""
        if self._lock_pid != os.getpid():
            self._init_process()
        return self._lock

    def _handles(self) -> Any:
        """This process' handles, opened on first use (again in a forked or unpickled copy)."""
        pid = os.getpid()
        state = self._state
        if state is not None and state[0] == pid:
            return state[1]
        with self._process_lock():
            if self._state is None or self._state[0] != pid:
                self._state = (pid, self._open())
            return self._state[1]

    def close(self) -> None:
        """Release this process' handles; later reads raise ``DatasetError``."""
        with self._process_lock():
            state, self._state = self._state, None
            self._closed = True
            if state is not None and state[0] == os.getpid():
                self._close(state[1])

    def release(self) -> None:  # noqa: B027 - most readers lock no file
        """Close the files this process holds open that a later read opens again (none here);
        for a dataset whose samples are all in memory, so it locks no file of them."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        for key in ("_lock", "_lock_pid", "_state", *self._transient):
            d.pop(key, None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self._init_process()

    # -- for subclasses ------------------------------------------------------------------
    def _select_fields(self, available: dict[str, FieldInfo], where: str) -> None:
        """Set ``self.fields`` from the spec (every available field when it names none).

        ``available`` carries the default spatial axes; a spec's ``FieldSpec`` replaces them.
        """
        if not available:
            raise DatasetError(where, "holds no arrays")
        self.found = dict(available)
        if not self.spec.fields:
            self.fields = dict(available)
        else:
            chosen = {}
            for fs in self.spec.fields:
                info = available.get(fs.name)
                if info is None:
                    raise DatasetError(
                        where, f"not in the data (it has: {', '.join(available)})", fs.name
                    )
                if fs.spatial_axes and fs.spatial_axes[-1] >= info.ndim:
                    raise DatasetError(
                        where,
                        f"spatial axes {fs.spatial_axes} do not fit the {info.ndim}-D per-sample "
                        f"shape {info.shape}",
                        fs.name,
                    )
                chosen[fs.name] = FieldInfo(
                    info.name, info.dtype, info.shape, fs.spatial_axes, info.chunks
                )
            self.fields = chosen
        self.stored = {n: f for n, f in self.fields.items() if _swapped(f.dtype)}
        self.fields = {n: _native(f) for n, f in self.fields.items()}
        self.found = {n: _native(f) for n, f in self.found.items()}
        label = self.spec.label
        if label is not None and label not in self.fields:
            raise DatasetError(where, f"label is not a field (fields: {self._names()})", label)

    def _path_of(self, index: int) -> str:
        """The file that holds sample ``index``, for messages."""
        return self.location

    @abstractmethod
    def _open(self) -> Any:
        """Open this process' handles."""

    def _close(self, handles: Any) -> None:  # noqa: B027 - most backends hold nothing to close
        """Release what ``_open`` returned."""

    @abstractmethod
    def _read_into(self, index: int, info: FieldInfo, sel: tuple[slice, ...], out: np.ndarray):
        """Fill ``out`` (C-contiguous, the region's shape, the field's dtype) with the box
        ``sel`` (explicit, in-range, non-empty slices) of ``info``'s field of sample ``index``."""


def _swapped(dtype: np.dtype) -> bool:
    """Numbers in the other byte order than this machine's (bytes and bools have none)."""
    return dtype.kind in "iufc" and not dtype.isnative


def _native(info: FieldInfo) -> FieldInfo:
    """``info`` in this machine's byte order."""
    if not _swapped(info.dtype):
        return info
    return dataclasses.replace(info, dtype=info.dtype.newbyteorder("="))

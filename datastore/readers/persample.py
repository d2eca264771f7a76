"""What the ``npy`` and ``tar`` readers share: samples located as arrays in files (a ``.npy`` or
``.npz`` file per sample, or members of a tar shard), checked against sample 0.

A region is read from a memory map of the file (or of the tar, at the member's offset), so only
the pages it covers are read; nothing is extracted. Members of a ``.npz`` written by
``np.savez_compressed`` are the exception: deflated, they are decoded whole (see ``npyfile``).
A ``.npy`` sample holds one field, named by the spec (``"data"`` when the spec names none); the
keys of a ``.npz`` sample are its fields. Headers are parsed on first read of each sample and
kept in a bounded cache; a sample whose dtype or shape differs from sample 0's is an error then
(and ``check_files``, which ``datastore inspect`` runs, looks at every sample).
"""

from __future__ import annotations

import zipfile
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from datastore.readers.base import DatasetError, FieldInfo, Reader, default_spatial_axes
from datastore.readers.labels import ValueArray
from datastore.readers.npyfile import StoredArray

__all__ = ["NPY_FIELD", "Located", "PerSampleFiles", "reading"]

NPY_FIELD = "data"  # the field of a .npy sample when the spec names none
CACHED_SAMPLES = 4096  # located samples kept per reader and process

Located = dict[str, StoredArray | ValueArray]


@contextmanager
def reading(where: str, kind: str, field: str | None) -> Iterator[None]:
    """Turn the errors of reading a ``.{kind}`` file (or member) at ``where`` into
    ``DatasetError``."""
    try:
        yield
    except DatasetError:
        raise
    except (ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DatasetError(where, f"not a valid .{kind} file: {exc}", field) from None
    except OSError as exc:
        raise DatasetError(where, f"cannot read: {exc.strerror or exc}", field) from None


class PerSampleFiles(Reader):
    """Samples whose arrays lie in files: located (``_locate``) on first read, cached, and
    checked against sample 0's dtypes and shapes."""

    _transient = ("_cache",)

    def _setup(self, one_array: bool) -> None:
        """Fields from sample 0. ``one_array``: every sample is one ``.npy`` array, which the
        spec's one field names (``NPY_FIELD`` when it names none)."""
        where = self._where(0)
        self._npy_field = NPY_FIELD
        if one_array and self.spec.fields:
            if len(self.spec.fields) > 1:
                raise DatasetError(
                    where,
                    f".npy samples hold one array; the spec names {len(self.spec.fields)} "
                    "fields (use .npz samples for several)",
                    self.spec.fields[1].name,
                )
            self._npy_field = self.spec.fields[0].name
        arrays = self._locate(0)
        available = {
            name: FieldInfo(name, a.dtype, a.shape, default_spatial_axes(len(a.shape)), None)
            for name, a in arrays.items()
        }
        self._select_fields(available, where)

    def _init_process(self) -> None:
        super()._init_process()
        self._cache: OrderedDict[int, Located] = OrderedDict()

    def _open(self) -> None:
        return None

    def check_files(self) -> None:
        """Locate every sample and check each field against sample 0."""
        for index in range(1, self._length):
            arrays = self._locate(index)
            for info in self._as_stored().values():
                self._checked(index, arrays, info)

    # -- for subclasses ------------------------------------------------------------------
    @abstractmethod
    def _locate(self, index: int) -> Located:
        """Where each array of sample ``index`` lies."""

    @abstractmethod
    def _where(self, index: int) -> str:
        """Sample ``index``'s file for messages."""

    def _path_of(self, index: int) -> str:
        return self._where(index)

    # -- checking ------------------------------------------------------------------------
    def _array(self, index: int, info: FieldInfo) -> StoredArray | ValueArray:
        lock = self._process_lock()
        with lock:
            arrays = self._cache.get(index)
            if arrays is not None:
                self._cache.move_to_end(index)
        if arrays is None:
            arrays = self._locate(index)
            if self.confine is not None:
                self._confine(arrays)
            with lock:
                self._cache[index] = arrays
                while len(self._cache) > CACHED_SAMPLES:
                    self._cache.popitem(last=False)
        return self._checked(index, arrays, info)

    def _confine(self, arrays: Located) -> None:
        """Pass the file each array of a sample was located in, as ``_locate`` opened it
        (``opened``, links resolved), to ``confine``: a file linked out of the service's roots
        after the dataset was opened was served. A later read of a file replaced since (a link
        swapped in) is refused by its ``stamp``."""
        for a in arrays.values():
            if a.opened is not None:
                self.confine(a.opened)

    def _checked(self, index: int, arrays: Located, info: FieldInfo) -> StoredArray | ValueArray:
        """``info``'s array of sample ``index``, if it has sample 0's dtype and shape (a
        decoded value may widen to it: an integer where sample 0 has a float; not a bool to a
        number, which numpy would allow)."""
        a = arrays.get(info.name)
        if a is None:
            raise DatasetError(
                self._where(index),
                f"sample {index} has no such array (it has: {', '.join(arrays) or 'none'})",
                info.name,
            )
        widens = (
            isinstance(a, ValueArray)
            and (a.dtype.kind == "b") == (info.dtype.kind == "b")
            and np.can_cast(a.dtype, info.dtype, "safe")
        )
        if (a.dtype != info.dtype and not widens) or a.shape != info.shape:
            raise DatasetError(
                self._where(index),
                f"sample {index} is {a.dtype.str} {a.shape}, sample 0 is "
                f"{info.dtype.str} {info.shape}",
                info.name,
            )
        return a

    def _read_into(self, index: int, info: FieldInfo, sel: tuple[slice, ...], out: np.ndarray):
        self._array(index, info).read_into(out, sel)

"""The ``npy`` and ``tar`` readers: one ``.npy`` or ``.npz`` file per sample, on its own or as
a member of an uncompressed tar shard.

A region is read from a memory map of the file (or of the tar, at the member's offset), so only
the pages it covers are read; nothing is extracted. Members of a ``.npz`` written by
``np.savez_compressed`` are the exception: deflated, they are decoded whole (see ``npyfile``).
A ``.npy`` sample holds one field, named by the spec (``"data"`` when the spec names none); the
keys of a ``.npz`` sample are its fields. Headers are parsed on first read of each sample and
kept in a bounded cache; a sample whose dtype or shape differs from sample 0's is an error then.
"""

from __future__ import annotations

import os
import tarfile
import zipfile
from abc import abstractmethod
from collections import OrderedDict

import numpy as np

from datastore.readers.base import DatasetError, FieldInfo, Reader, default_spatial_axes
from datastore.readers.npyfile import RawArray, ZippedArray, locate_npy, locate_npz
from datastore.readers.spec import DatasetSpec, resolve_paths

__all__ = ["NPY_FIELD", "NpyReader", "TarReader"]

NPY_FIELD = "data"  # the field of a .npy sample when the spec names none
CACHED_SAMPLES = 4096  # located samples kept per reader and process
_COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
}

Located = dict[str, RawArray | ZippedArray]


class _PerSampleFiles(Reader):
    """Samples are ``.npy``/``.npz`` files, each at ``(path, base, size)``."""

    _transient = ("_cache",)

    def _setup(self, first_name: str) -> None:
        """``self.kind`` from the sample names; fields from sample 0."""
        self.kind = "npz" if first_name.lower().endswith(".npz") else "npy"
        where = self._where(0)
        if self.kind == "npy":
            if len(self.spec.fields) > 1:
                raise DatasetError(
                    where,
                    f".npy samples hold one array; the spec names {len(self.spec.fields)} "
                    "fields (use .npz samples for several)",
                    self.spec.fields[1].name,
                )
            self._npy_field = self.spec.fields[0].name if self.spec.fields else NPY_FIELD
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

    # -- for subclasses ------------------------------------------------------------------
    @abstractmethod
    def _entry(self, index: int) -> tuple[str, int, int | None]:
        """Sample ``index``'s file: ``(path, offset, size or None for "to the end")``."""

    @abstractmethod
    def _where(self, index: int) -> str:
        """Sample ``index``'s file for messages."""

    def _path_of(self, index: int) -> str:
        return self._where(index)

    # -- locating ------------------------------------------------------------------------
    def _locate(self, index: int) -> Located:
        path, base, size = self._entry(index)
        field = self._npy_field if self.kind == "npy" else None
        try:
            if self.kind == "npy":
                return {self._npy_field: locate_npy(path, base, size)}
            return locate_npz(path, base, size)
        except (ValueError, zipfile.BadZipFile, EOFError) as exc:
            where, reason = self._where(index), f"not a valid .{self.kind} file: {exc}"
            raise DatasetError(where, reason, field) from None
        except OSError as exc:
            where, reason = self._where(index), f"cannot read: {exc.strerror or exc}"
            raise DatasetError(where, reason, field) from None

    def _array(self, index: int, info: FieldInfo) -> RawArray | ZippedArray:
        lock = self._process_lock()
        with lock:
            arrays = self._cache.get(index)
            if arrays is not None:
                self._cache.move_to_end(index)
        if arrays is None:
            arrays = self._locate(index)
            with lock:
                self._cache[index] = arrays
                while len(self._cache) > CACHED_SAMPLES:
                    self._cache.popitem(last=False)
        a = arrays.get(info.name)
        if a is None:
            raise DatasetError(
                self._where(index),
                f"sample {index} has no such array (it has: {', '.join(arrays)})",
                info.name,
            )
        if a.dtype != info.dtype or a.shape != info.shape:
            raise DatasetError(
                self._where(index),
                f"sample {index} is {a.dtype.str} {a.shape}, sample 0 is "
                f"{info.dtype.str} {info.shape}",
                info.name,
            )
        return a

    def _read_into(self, index: int, info: FieldInfo, sel: tuple[slice, ...], out: np.ndarray):
        self._array(index, info).read_into(out, sel)


class NpyReader(_PerSampleFiles):
    """``npy``: file ``k`` (in path order) is sample ``k``; all ``.npy`` or all ``.npz``."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        kinds = {os.path.splitext(f)[1].lower() for f in self.files}
        if len(kinds) != 1 or not kinds <= {".npy", ".npz"}:
            raise DatasetError(
                self.location, f"samples must be all .npy or all .npz files, found {sorted(kinds)}"
            )
        self._length = len(self.files)
        self._setup(self.files[0])

    def _entry(self, index: int) -> tuple[str, int, int | None]:
        return self.files[index], 0, None

    def _where(self, index: int) -> str:
        return self.files[index]


class TarReader(_PerSampleFiles):
    """``tar``: uncompressed shards (in path order) whose members (in tar order) are samples,
    all ``.npy`` or all ``.npz``; directory members are skipped, anything else is an error."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        # (shard, member name, data offset, size) per sample: picklable, so workers never rescan
        self._members: list[tuple[int, str, int, int]] = []
        for k, path in enumerate(self.files):
            self._members.extend((k, *m) for m in _index_tar(path))
        if not self._members:
            raise DatasetError(self.location, "the tar shards hold no .npy/.npz members")
        kinds = {os.path.splitext(m[1])[1].lower() for m in self._members}
        if len(kinds) != 1:
            raise DatasetError(
                self.location, f"members must be all .npy or all .npz, found {sorted(kinds)}"
            )
        self._length = len(self._members)
        self._setup(self._members[0][1])

    def _entry(self, index: int) -> tuple[str, int, int | None]:
        k, _, offset, size = self._members[index]
        return self.files[k], offset, size

    def _where(self, index: int) -> str:
        k, name, _, _ = self._members[index]
        return f"{self.files[k]}[{name}]"


def _index_tar(path: str) -> list[tuple[str, int, int]]:
    """``(name, data offset, size)`` of each ``.npy``/``.npz`` member, reading headers only."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
            end = os.fstat(fh.fileno()).st_size
    except OSError as exc:
        raise DatasetError(path, f"cannot read: {exc.strerror or exc}") from None
    for sig, name in _COMPRESSED.items():
        if magic.startswith(sig):
            raise DatasetError(
                path,
                f"a {name}-compressed tar cannot be read by offset; unpack it "
                "(datastore stage) or write it uncompressed",
            )
    out = []
    try:
        with tarfile.open(path, "r:") as tf:
            for m in tf:  # each step reads one header and seeks over the member's data
                if m.isdir():
                    continue
                if not m.isreg() or m.sparse is not None:
                    raise DatasetError(path, f"member {m.name!r} is not a regular file")
                if not m.name.lower().endswith((".npy", ".npz")):
                    raise DatasetError(path, f"member {m.name!r} is neither .npy nor .npz")
                if m.offset_data + m.size > end:
                    raise DatasetError(path, f"member {m.name!r} is truncated")
                out.append((m.name, m.offset_data, m.size))
    except tarfile.TarError as exc:
        raise DatasetError(path, f"not a readable tar archive: {exc}") from None
    except OSError as exc:
        raise DatasetError(path, f"cannot read: {exc.strerror or exc}") from None
    return out

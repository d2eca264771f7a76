"""Where the arrays of a ``.npy`` or ``.npz`` file lie, so that a region is read from a memory map.

A file here may start at an offset inside another file (a member of an uncompressed tar), so
every function takes ``(path, base, size)``: the bytes ``[base, base + size)`` of ``path``.

- ``.npy``: the header (format 1.0 or 2.0) is parsed with ``numpy.lib.format``; the data is a
  ``RawArray`` at ``base + header length``.
- ``.npz`` written by ``np.savez`` (members stored): each member's data lies uncompressed at a
  fixed offset (the zip local header, then the ``.npy`` header), also a ``RawArray``.
- ``.npy`` bytes in memory (an LMDB record): ``npy_in_buffer``, a view of them.
- ``.npz`` written by ``np.savez_compressed`` (members deflated): a ``ZippedArray``, which must
  decode the whole member to read any region of it.
"""

from __future__ import annotations

import functools
import io
import os
import struct
import threading
import zipfile
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from staging.confine import open_regular, opened_path
from staging.directio import PositionedReader

__all__ = [
    "RawArray",
    "StoredArray",
    "ZippedArray",
    "check_stamp",
    "file_stamp",
    "locate_npy",
    "locate_npz",
    "npy_in_buffer",
]

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra length


@dataclass(frozen=True)
class StoredArray:
    """An array that lies in the file ``path``: its ``dtype``, ``shape`` and order (as a
    ``.npy`` header gives them); :meth:`read_into` copies a box of it."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    stamp: tuple[int, int, int, int] | None = field(default=None, kw_only=True)
    """The file's ``file_stamp`` when the array was found in it: a read of a file with another
    stamp is refused, its bytes there may be anything now."""
    opened: str | None = field(default=None, kw_only=True)
    """The file the array was found in, as opened (links resolved; ``stamp``'s file): what
    ``datastore serve --allow`` checks."""

    def read_into(self, out: np.ndarray, sel: tuple[slice, ...]) -> None:
        raise NotImplementedError

    def _check_stamp(self, fd: int) -> None:
        check_stamp(fd, self.path, self.stamp)


def check_stamp(fd: int, path: str, stamp: tuple[int, int, int, int] | None) -> None:
    """Refuse to read ``path``, open as ``fd``, when its ``file_stamp`` is not ``stamp`` (taken
    when what is read was found in it; ``None``: not checked).

    Raises:
        ValueError: naming ``path``, replaced or rewritten since.
    """
    if stamp is not None and file_stamp(fd) != stamp:
        raise ValueError(
            f"{path} changed since the dataset was opened (replaced or rewritten): "
            "open it again to read the new data"
        )


def file_stamp(fd: int) -> tuple[int, int, int, int]:
    """``(device, inode, size, mtime_ns)`` of the open file ``fd``: it changes when the file is
    replaced (a new file renamed over it) or rewritten in place."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True, kw_only=True)
class RawArray(StoredArray):
    """An array stored raw at byte ``offset`` of ``path``."""

    offset: int

    def read_into(self, out: np.ndarray, sel: tuple[slice, ...]) -> None:
        """Copy the box ``sel`` into ``out`` (C-contiguous), reading only the bytes it covers.

        A C-ordered array is read with one ``preadv`` per contiguous run of the box (a whole
        sample is one read, a depth slab one read per channel) straight into ``out``; a box
        that would need more than ``MAX_RUNS`` reads (e.g. blocks split along the last axis),
        or a Fortran-ordered array, is copied out of a memory map instead.
        """
        bounds = tuple(x.indices(n)[:2] for x, n in zip(sel, self.shape, strict=True))
        runs = None if self.fortran else _c_runs(self.shape, bounds, self.dtype.itemsize)
        if runs is None or not out.flags.c_contiguous:
            self._mapped_into(out, sel)
            return
        offsets, run = runs
        flat = out.reshape(-1).view(np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._check_stamp(fd)
            for i, off in enumerate(offsets):
                got = os.preadv(fd, [flat[i * run : (i + 1) * run]], self.offset + off)
                if got != run:
                    raise ValueError(f"{self.path}: file ends before the array its header declares")
        finally:
            os.close(fd)

    def _mapped_into(self, out: np.ndarray, sel: tuple[slice, ...]) -> None:
        with open(self.path, "rb") as fh:
            self._check_stamp(fh.fileno())
            mm = np.memmap(
                fh,
                dtype=self.dtype,
                mode="r",
                offset=self.offset,
                shape=self.shape,
                order="F" if self.fortran else "C",
            )
        np.copyto(out, mm[sel])
        del mm  # the last reference: unmapped now


MAX_RUNS = 1024


@functools.lru_cache(maxsize=256)
def _c_runs(
    shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...], item: int
) -> tuple[tuple[int, ...], int] | None:
    """Byte offsets and length of the contiguous runs of the box ``bounds`` (``(start, stop)``
    per axis) in a C-ordered array of ``shape``, in C order; ``None`` if there would be more
    than ``MAX_RUNS`` of them. Cached: a loader reads the same box of every sample."""
    if not shape:
        return (0,), item
    sizes = [hi - lo for lo, hi in bounds]
    if min(sizes) <= 0:
        return (), 0
    k = len(shape) - 1  # axes after k are taken whole: each run spans them
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [int(np.prod(shape[j + 1 :], dtype=np.int64)) for j in range(len(shape))]
    count = int(np.prod(sizes[:k], dtype=np.int64))
    if count > MAX_RUNS:
        return None
    base = sum(lo * st for (lo, _), st in zip(bounds, strides, strict=True))
    idx = np.indices(sizes[:k]).reshape(k, -1).T if k else np.zeros((1, 0), np.int64)
    offsets = tuple((base + int(np.dot(i, strides[:k]))) * item for i in idx)
    return offsets, sizes[k] * strides[k] * item


@dataclass(frozen=True, kw_only=True)
class ZippedArray(StoredArray):
    """A deflated ``.npz`` member: ``member`` of the zip at ``[base, base + size)`` of ``path``."""

    base: int
    size: int
    member: str

    def read_into(self, out: np.ndarray, sel: tuple[slice, ...]) -> None:
        """Decode the whole member, then copy the box ``sel`` into ``out``."""
        with open(self.path, "rb") as fh:
            self._check_stamp(fh.fileno())
            with (
                zipfile.ZipFile(_Window(fh, self.base, self.size)) as zf,
                zf.open(self.member) as m,
            ):
                arr = np.lib.format.read_array(m, allow_pickle=False)
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError(f"member {self.member} changed since it was indexed")
        np.copyto(out, arr[sel])


class _Window(PositionedReader):
    """The bytes ``[base, base + size)`` of an open file, as a seekable read-only file."""

    def __init__(self, fh: BinaryIO, base: int, size: int):
        self._fd, self._pos, self.base, self.size = fh.fileno(), 0, base, size

    def _end(self) -> int:
        return self.size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, super().seek(offset, whence))  # no position before the window
        return self._pos

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(b), self.size - self._pos))
        if n == 0:
            return 0
        data = os.pread(self._fd, n, self.base + self._pos)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


# numpy parses a header with ast.literal_eval, which CPython 3.11 (before 3.11.8) may fail
# with "SystemError: AST constructor recursion depth mismatch" when threads parse at once
# (python/cpython#106905); we read headers from many threads, so one parse at a time.
_HEADER_PARSE = threading.Lock()


def _header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    """The ``.npy`` header at ``f``'s position; ``f`` is left at the start of the data."""
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported")
    with _HEADER_PARSE:
        try:
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        except (ValueError, SyntaxError, TypeError, RecursionError) as exc:
            # numpy's own reasons are kept; not ast.literal_eval's ("<ast.Name object at ...>")
            why = str(exc)
            why = f" ({why})" if why and "<ast." not in why and len(why) <= 200 else ""
            raise ValueError(f"its .npy header is malformed{why}") from None
    if dtype.hasobject:
        raise ValueError("the array holds Python objects (pickled), which are not read")
    return tuple(shape), bool(fortran), dtype


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _size(path: str, size: int | None) -> int:
    return os.stat(path).st_size if size is None else size


def locate_npy(path: str, base: int = 0, size: int | None = None) -> RawArray:
    """The array of the ``.npy`` file at ``[base, base + size)`` of ``path`` (``size=None``:
    to the end of the file). Raises ``ValueError`` (the reason) for a malformed or truncated
    file, ``OSError`` for one that cannot be read."""
    size = _size(path, size)
    with open(open_regular(path), "rb") as fh:
        win = _Window(fh, base, size)
        shape, fortran, dtype = _header(win)
        start = win.tell()
        stamp, opened = file_stamp(fh.fileno()), opened_path(fh.fileno())
    need = start + _nbytes(shape, dtype)
    if need > size:
        raise ValueError(f"truncated: the header promises {need} bytes, there are {size}")
    return RawArray(path, dtype, shape, fortran, offset=base + start, stamp=stamp, opened=opened)


def locate_npz(path: str, base: int = 0, size: int | None = None) -> dict[str, StoredArray]:
    """``{key: array}`` of the ``.npz`` file at ``[base, base + size)`` of ``path``; keys are
    member names without ``.npy``, as ``np.load`` gives them. Raises ``ValueError`` or
    ``zipfile.BadZipFile`` for a malformed file, ``OSError`` for one that cannot be read."""
    size = _size(path, size)
    out: dict[str, StoredArray] = {}
    with open(open_regular(path), "rb") as fh:
        stamp, opened = file_stamp(fh.fileno()), opened_path(fh.fileno())
        win = _Window(fh, base, size)
        with zipfile.ZipFile(win) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                key = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                if info.compress_type != zipfile.ZIP_STORED:
                    with zf.open(info) as m:
                        shape, fortran, dtype = _header(m)
                    out[key] = ZippedArray(
                        path, dtype, shape, fortran, base=base, size=size, member=info.filename,
                        stamp=stamp, opened=opened,
                    )  # fmt: skip
                    continue
                win.seek(info.header_offset)
                sig, name_len, extra_len = _LOCAL_HEADER.unpack(win.read(_LOCAL_HEADER.size))
                if sig != b"PK\x03\x04":
                    raise ValueError(f"member {info.filename}: bad zip local header")
                data = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
                win.seek(data)
                shape, fortran, dtype = _header(win)
                start = win.tell()
                if start - data + _nbytes(shape, dtype) > info.file_size:
                    raise ValueError(f"member {info.filename}: truncated array data")
                out[key] = RawArray(
                    path, dtype, shape, fortran, offset=base + start, stamp=stamp, opened=opened
                )
    return out


def npy_in_buffer(buf: bytes | memoryview) -> np.ndarray:
    """The array of the ``.npy`` bytes ``buf`` (what ``np.save`` writes), as a read-only view
    of ``buf``. Raises ``ValueError`` (the reason) for bytes that are not exactly one array."""
    head = bytes(buf[:12])
    if head[:6] != b"\x93NUMPY" or len(head) < 10:
        raise ValueError("not .npy bytes (no \\x93NUMPY magic)")
    small = head[6] == 1  # format 1.0: a 2-byte header length; 2.0 and 3.0: 4 bytes
    start = (
        10 + int.from_bytes(head[8:10], "little")
        if small
        else 12 + int.from_bytes(head[8:12], "little")
    )
    shape, fortran, dtype = _header(io.BytesIO(bytes(buf[:start])))
    size = len(buf) - start
    if size != _nbytes(shape, dtype):
        raise ValueError(
            f"the .npy header declares {dtype.str} {shape} ({_nbytes(shape, dtype)} bytes of "
            f"data), the record holds {size}"
        )
    flat = np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=start)
    return flat.reshape(shape, order="F" if fortran else "C")

"""The ``zarr`` reader: a group (zarr format 2 or 3), one array per field with a sample axis.

A region is a basic selection, so zarr fetches and decodes only the chunks (of a sharded array:
the inner chunks) that meet it, and writes the result into the caller's buffer. Nested arrays
are fields named by their path in the group (``"grp/x"``). zarr arrays are safe to read from
several threads; each process opens the group once (zarr resets its I/O loop after a fork).
zarr itself (a quarter of a second to import) loads when a group is first opened, so that
importing the readers (``spec`` imports them all) does not pay for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from datastore.readers.base import DatasetError, FieldInfo, Reader, default_spatial_axes
from datastore.readers.registry import Format, register, resolve_paths
from staging.confine import open_regular, opened_path

if TYPE_CHECKING:
    from datastore.readers.spec import DatasetSpec

__all__ = ["ZarrReader"]


class ZarrReader(Reader):
    """``zarr``: every array of the group with at least one axis is a field (0-D ones are
    skipped); all fields share the length of the sample axis."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        root = self.files[0]
        if not os.path.isdir(root):
            raise DatasetError(root, "a zarr dataset is a directory")
        group = _open_group(root)
        self.zarr_format: int = group.metadata.zarr_format
        arrays = _arrays(root, group)
        available = {}
        for name, arr in arrays.items():
            if arr.ndim == 0:
                continue
            shape = tuple(arr.shape[1:])
            chunks = _chunks(arr)
            available[name] = FieldInfo(
                name, arr.dtype, shape, default_spatial_axes(len(shape)), chunks
            )
        self._select_fields(available, root)
        count: tuple[str, int] | None = None
        for name in self.fields:
            n = arrays[name].shape[0]
            if count is None:
                count = (name, n)
            elif n != count[1]:
                raise DatasetError(
                    root,
                    f"has {n} samples but field {count[0]!r} has {count[1]}; "
                    "name the fields to read (fields=[...], or a spec's fields)",
                    name,
                )
        self._length = 0 if count is None else count[1]
        self._stamps = {name: _meta_stamp(root, name) for name in self.fields}
        orders = {name: _stored_order(arrays[name]) for name in self.fields}
        self._orders = {name: o for name, o in orders.items() if o is not None}

    def stored_dtype(self, name: str) -> np.dtype:
        """As stored: a format-3 array's ``bytes`` codec holds the byte order (zarr decodes
        into this machine's; ``inspect`` showed ``float32`` for a big-endian array)."""
        dtype = super().stored_dtype(name)
        order = self._orders.get(name)
        return dtype if order is None else dtype.newbyteorder(order)

    def _open(self) -> dict[str, Any]:
        root = self.files[0]
        return _arrays(root, _open_group(root, self.confine))

    def _read_into(self, index: int, info: FieldInfo, sel: tuple[slice, ...], out: np.ndarray):
        arr = self._handles().get(info.name)
        if arr is None:
            raise DatasetError(self.files[0], "the array is gone from the group", info.name)
        if _meta_stamp(self.files[0], info.name) != self._stamps[info.name]:
            raise DatasetError(
                self.files[0],
                "the array changed since the dataset was opened (its metadata was rewritten): "
                "open it again to read the new data",
                info.name,
            )
        from zarr.core.buffer.cpu import NDBuffer

        arr.get_basic_selection((index, *sel), out=NDBuffer.from_numpy_array(out))


def _meta_stamp(root: str, name: str) -> tuple[int, int, int] | None:
    """``(inode, size, mtime_ns)`` of array ``name``'s metadata file (format 3's ``zarr.json``,
    or 2's ``.zarray``): it changes when the array is written anew. ``None``: neither is there."""
    for meta in ("zarr.json", ".zarray"):
        try:
            st = os.stat(os.path.join(root, name, meta))
        except FileNotFoundError:
            continue
        return st.st_ino, st.st_size, st.st_mtime_ns
    return None


def _stored_order(arr: Any) -> str | None:
    """``">"`` or ``"<"``: the byte order a format-3 array's ``bytes`` codec stores (of a
    sharded array: its chunks'), where it is not this machine's; else ``None`` (format 2's
    dtype gives its byte order itself)."""
    endian = getattr(getattr(arr, "serializer", None), "endian", None)
    if arr.metadata.zarr_format != 3 or endian is None:
        return None
    order = ">" if endian.value == "big" else "<"
    return None if np.dtype(arr.dtype).newbyteorder(order).isnative else order


def _chunks(arr: Any) -> tuple[int, ...] | None:
    try:
        return tuple(arr.chunks[1:])
    except (AttributeError, NotImplementedError, TypeError):  # e.g. a variable chunk grid
        return None


def _open_group(root: str, confine: Callable[[str], None] | None = None) -> Any:
    import zarr
    from zarr.errors import ContainsArrayError

    try:
        return zarr.open_group(root if confine is None else _confined(root, confine), mode="r")
    except ContainsArrayError:
        raise DatasetError(
            root, "a zarr array, not a group; write the fields into a group"
        ) from None
    except Exception as exc:  # zarr raises many kinds for a missing or broken group
        reason = f"not a readable zarr group: {type(exc).__name__}: {exc}"
        raise DatasetError(root, reason) from None


def _confined(root: str, confine: Callable[[str], None]) -> Any:
    """A read-only store of ``root`` that calls ``confine`` with the file each read opened,
    links resolved, before reading it: a chunk linked out of the service's roots after the
    dataset was opened was served."""
    import asyncio

    from zarr.core.buffer import default_buffer_prototype
    from zarr.storage import LocalStore
    from zarr.storage._local import _get

    def get(path: Path, prototype: Any, byte_range: Any) -> Any:
        fd = open_regular(path)
        try:
            confine(opened_path(fd))
            return _get(Path(f"/proc/self/fd/{fd}"), prototype, byte_range)  # the file opened
        finally:
            os.close(fd)

    class Confined(LocalStore):
        async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
            if not self._is_open:
                await self._open()
            try:
                return await asyncio.to_thread(
                    get, self.root / key, prototype or default_buffer_prototype(), byte_range
                )
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None

    return Confined(root, read_only=True)


def _arrays(root: str, group: Any) -> dict[str, Any]:
    """Every array under ``group``, by path."""
    import zarr

    try:
        members = group.members(max_depth=None)
    except Exception as exc:
        raise DatasetError(root, f"cannot list the group: {type(exc).__name__}: {exc}") from None
    return {
        name: m for name, m in sorted(members, key=lambda nm: nm[0]) if isinstance(m, zarr.Array)
    }


def _is_group(path: str) -> bool:
    """Whether the directory ``path`` is a zarr group (format 3's ``zarr.json`` or format 2's
    ``.zgroup``); a zarr array is refused."""
    if os.path.exists(os.path.join(path, "zarr.json")) or os.path.exists(
        os.path.join(path, ".zgroup")
    ):
        return True
    if os.path.exists(os.path.join(path, ".zarray")):
        raise DatasetError(path, "a zarr array, not a group; write the fields into a group")
    return False


register(Format("zarr", ZarrReader, whole=True, marker=_is_group))

"""The ``tar`` reader: uncompressed tar shards whose members sharing a key are one sample
(WebDataset's layout, ``tar_keys``), read at their offsets in the tar without extracting.

Each member of a sample gives fields by its kind and slot (``000123.x.npy``: slot ``x``):

- ``.npy``: one array, the field named by the slot (``KEY.npy``: ``"data"``, or the spec's one
  field when every sample is one ``.npy`` member);
- ``.npz``: its arrays, named by their keys (``a`` in ``KEY.s.npz``: field ``"s.a"``);
- ``.cls``: an integer as text, one ``int64`` field named by the slot (``"cls"``);
- ``.json``: its numbers, bools and rectangular lists of them (``labels``): a value is the
  field named by the slot, an object's keys are fields (``"label"`` in ``KEY.json``: field
  ``"label"``; in ``KEY.meta.json``: ``"meta.label"``);
  ``read_json`` returns the whole parsed document.

Arrays are read from a memory map of the tar; ``.cls`` and ``.json`` members are read and
decoded when their sample is first located.
"""

from __future__ import annotations

import json
import os
import tarfile
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from datastore.readers.base import DatasetError
from datastore.readers.labels import class_label, json_arrays
from datastore.readers.npyfile import file_stamp, locate_npy, locate_npz, opened_path
from datastore.readers.persample import Located, PerSampleFiles, reading
from datastore.readers.registry import Format, register, resolve_paths
from datastore.readers.tar_keys import Entry, Sample, group_samples
from staging.archive import StrictInfo
from staging.confine import open_regular

if TYPE_CHECKING:
    from datastore.readers.spec import DatasetSpec

__all__ = ["TarReader"]

_COMPRESSED = {
    b"\x1f\x8b": "gzip",
    b"\x28\xb5\x2f\xfd": "zstd",
    b"BZh": "bzip2",
    b"\xfd7zXZ\x00": "xz",
}


class TarReader(PerSampleFiles):
    """``tar``: the samples of uncompressed shards (in path order), each the members that
    share a key; directory members are skipped, anything but a regular file is an error."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        # (shard, key, members) per sample: picklable, so workers never rescan
        self._samples: list[Sample] = group_samples([(p, _index_tar(p)) for p in self.files])
        if not self._samples:
            raise DatasetError(self.location, "the tar shards hold no members")
        self._length = len(self._samples)
        # shard k holds samples offsets[k]:offsets[k + 1] (``datastore.store.shards`` reads it)
        per_shard = np.bincount([k for k, _, _ in self._samples], minlength=len(self.files))
        self.offsets = np.zeros(len(self.files) + 1, dtype=np.int64)
        np.cumsum(per_shard, out=self.offsets[1:])
        slots = [(slot, kind) for slot, kind, *_ in self._samples[0][2]]
        self._setup(slots == [("npy", "npy")])

    def read_json(self, index: int, member: str = "json") -> Any:
        """The parsed ``.json`` member ``member`` of sample ``index`` (its slot: ``"json"``
        for ``KEY.json``, ``"meta"`` for ``KEY.meta.json``), strings and all.

        Raises:
            DatasetError: naming the shard and the key, for a bad index, a sample with no
                such member, or a member that is not JSON.
        """
        i = self._check_index(index, member)
        shard, _, entries = self._samples[i]
        for slot, kind, name, offset, size in entries:
            if (slot, kind) == (member, "json"):
                path = self.files[shard]
                with reading(f"{path}[{name}]", kind, member), open(path, "rb") as fh:
                    return json.loads(_member_bytes(fh.fileno(), offset, size))
        raise DatasetError(self._where(i), "no such .json member", member)

    def _locate(self, index: int) -> Located:
        shard, key, entries = self._samples[index]
        path = self.files[shard]
        out: Located = {}
        source: dict[str, str] = {}  # field -> the member it came from
        for entry in entries:
            for field, array in self._decode(path, entry).items():
                if field in out:
                    raise DatasetError(
                        self._where(index),
                        f"sample {key!r} gets this field from two members: "
                        f"{source[field]!r} and {entry[2]!r}",
                        field,
                    )
                out[field], source[field] = array, entry[2]
        return out

    def _decode(self, path: str, entry: Entry) -> Located:
        """The fields of one member."""
        slot, kind, name, offset, size = entry
        named = slot != kind  # KEY.SLOT.KIND, not KEY.KIND
        field = slot if named or kind != "npy" else self._npy_field
        prefix = f"{slot}." if named else ""
        with reading(f"{path}[{name}]", kind, field):
            if kind == "npy":
                return {field: locate_npy(path, offset, size)}
            if kind == "npz":
                return {prefix + k: a for k, a in locate_npz(path, offset, size).items()}
            with open(open_regular(path), "rb") as fh:
                fd = fh.fileno()
                data = _member_bytes(fd, offset, size)
                read = {"path": path, "stamp": file_stamp(fd), "opened": opened_path(fd)}
            if kind == "cls":
                return {field: replace(class_label(data), **read)}
            return {k: replace(v, **read) for k, v in json_arrays(data, field, prefix).items()}

    def _where(self, index: int) -> str:
        shard, key, _ = self._samples[index]
        return f"{self.files[shard]}[{key}]"


def _member_bytes(fd: int, offset: int, size: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise ValueError(f"truncated: {len(data)} of {size} bytes")
    return data


def _index_tar(path: str) -> list[tuple[str, int, int]]:
    """``(name, data offset, size)`` of each regular member, reading headers only."""
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
        with tarfile.open(path, "r:", tarinfo=StrictInfo) as tf:  # a bad header: not the end
            for m in tf:  # each step reads one header and seeks over the member's data
                if m.isdir():
                    continue
                if not m.isreg() or m.sparse is not None:
                    raise DatasetError(path, f"member {m.name!r} is not a regular file")
                if m.offset_data + m.size > end:
                    raise DatasetError(path, f"member {m.name!r} is truncated")
                out.append((m.name, m.offset_data, m.size))
    except tarfile.TarError as exc:
        raise DatasetError(path, f"not a readable tar archive: {exc}") from None
    except OSError as exc:
        raise DatasetError(path, f"cannot read: {exc.strerror or exc}") from None
    return out


_COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.zst", ".tzst", ".tar.bz2", ".tar.xz")
_UNPACK = "a compressed tar cannot be read by offset; unpack it (datastore stage) first"
register(
    Format(
        "tar", TarReader, suffixes=(".tar",), refused=dict.fromkeys(_COMPRESSED_SUFFIXES, _UNPACK)
    )
)

"""HDF5 readers: ``hdf5`` (datasets with a sample axis, in one or more shard files) and
``hdf5-per-sample`` (one file per sample).

Datasets stored as plain bytes (no filters, native byte order; contiguous or chunked) are
read without HDF5: each chunk's byte offset is looked up once, and a region is read with one
``preadv`` per contiguous run of each chunk it meets, straight into the caller's buffer
(h5py's per-call overhead otherwise dominates small region reads). Other datasets are read
as HDF5 hyperslabs (``read_direct``), so only the chunks or byte runs that meet the region
are read.
h5py serializes every call behind its own global lock, so one lock per reader costs no
parallelism; it also keeps a handle from being closed (by the bounded cache of open files)
while another thread reads through it. The chunk cache is off (``rdcc_nbytes=0``): every
(sample, block) is read once into the store, so a cache only adds a copy; without it a block
read of an uncompressed chunk reads just the block's bytes (measured: a 10/64-depth block of a
4 MiB chunk in 211 us instead of 459 us). Other access properties are h5py's defaults: HDF5
refuses a second open of a file in one process with a different locking flag. On filesystems without
``flock`` set ``HDF5_USE_FILE_LOCKING=FALSE``, as for any HDF5 program.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np
from h5py import h5s, h5t, h5z

from datastore.readers.base import (
    DatasetError,
    DatasetMissing,
    FieldInfo,
    Reader,
    default_spatial_axes,
)
from datastore.readers.npyfile import RawArray, file_stamp
from datastore.readers.registry import LAYOUTS, Format, register, resolve_paths
from staging.confine import opened_path

if TYPE_CHECKING:
    from datastore.readers.spec import DatasetSpec

__all__ = [
    "FORMAT_OF_LAYOUT",
    "LAYOUT_ATTR",
    "AmbiguousLayout",
    "Hdf5PerSampleReader",
    "Hdf5Reader",
    "SourceError",
    "SourceMissing",
    "reached_files",
    "set_format",
    "shard_count",
]

FORMAT_OF_LAYOUT = {"shards": "hdf5", "per-sample": "hdf5-per-sample"}
LAYOUT_ATTR = "datastore_layout"  # a file attribute: how a set of HDF5 files holds its samples
MAX_OPEN_FILES = 64  # per reader and process; hdf5-per-sample datasets have one file per sample


def _open_file(path: str) -> h5py.File:
    try:
        return h5py.File(path, "r", rdcc_nbytes=0)
    except BlockingIOError:  # HDF5's own lock: a writer has the file open
        raise DatasetError(
            path, "another process has it open for writing (HDF5's file lock): read it once "
            "the writer has closed it",
        ) from None  # fmt: skip
    except (OSError, ValueError) as exc:
        raise DatasetError(path, f"not a readable HDF5 file: {exc}") from None


def _datasets(f: h5py.File, path: str, names: list[str] | None) -> dict[str, h5py.Dataset]:
    """``{name: dataset}``: the ``names`` asked for, or every dataset in the file (by path),
    then every dataset that an external link in it names or holds in the group it names
    (``visititems`` passes them by)."""
    if names is None:
        found: dict[str, h5py.Dataset] = {}
        external: list[tuple[str, h5py.ExternalLink]] = []

        def visit_link(name: str, link: Any) -> None:
            if isinstance(link, h5py.ExternalLink):
                external.append((name, link))

        _collect(f, "", found)
        f.visititems_links(visit_link)
        for name, link in external:  # opened after the visit: h5py's callbacks must not raise
            obj = _linked(f, path, name, link)
            if isinstance(obj, h5py.Dataset):
                found[name] = obj
            elif isinstance(obj, h5py.Group):  # its datasets (not its own links' ones)
                _collect(obj, f"{name}/", found)
        return found
    out = {}
    for name in names:
        obj = _get(f, path, name)
        if obj is None:
            has = ", ".join(_datasets(f, path, None)) or "no datasets"
            raise DatasetError(path, f"not in the data (it has: {has})", name)
        if not isinstance(obj, h5py.Dataset):
            raise DatasetError(path, "a group, not a dataset", name)
        out[name] = obj
    return out


def _collect(group: h5py.Group, prefix: str, found: dict[str, h5py.Dataset]) -> None:
    """Add every dataset under ``group`` to ``found``, by its path there after ``prefix``."""

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            found[prefix + name] = obj

    group.visititems(visit)


def _linked(f: h5py.File, path: str, name: str, link: h5py.ExternalLink) -> Any:
    """The object that the external link ``name`` of ``f`` names.

    Raises:
        DatasetError: naming the link and its target when that cannot be opened, or is no
            regular file (opening a FIFO would block).
    """
    for target in _places(link.filename, path):
        _regular(target, path, name)
    try:
        return f[name]
    except (KeyError, OSError) as exc:
        raise DatasetError(
            path,
            f"external link to {link.filename}:{link.path} cannot be opened ({exc}); name the "
            "fields to read (fields=[...], or a spec's fields) to leave it out",
            name,
        ) from None


def _check_filters(found: dict[str, h5py.Dataset], path: str, names: Any) -> None:
    """Refuse a field of ``names`` compressed by an HDF5 filter that this process cannot load
    (a plugin's, such as Blosc or Zstd): every read of it would fail. A filter that is
    optional (as h5py sets a plugin's) counts when the first stored chunk went through it.

    Raises:
        DatasetError: naming the file, the field and the filter.
    """
    for name in names:
        ds = found[name]
        dcpl = ds.id.get_create_plist()
        for i in range(dcpl.get_nfilters()):
            code, flags, _, label = dcpl.get_filter(i)
            if h5z.filter_avail(code) or (flags & h5z.FLAG_OPTIONAL and not _applied(ds, i)):
                continue
            raise DatasetError(
                path,
                f"compressed with HDF5 filter {code} ({label.decode().split(';')[0] or 'unnamed'}"
                "), which this process cannot load: import hdf5plugin (pip install hdf5plugin) "
                "before opening it, or set HDF5_PLUGIN_PATH",
                name,
            )


def _applied(ds: h5py.Dataset, i: int) -> bool:
    """Whether filter ``i`` of the pipeline was applied to the first stored chunk of ``ds``."""
    if ds.chunks is None or not ds.id.get_num_chunks():
        return False
    return not ds.id.get_chunk_info(0).filter_mask & (1 << i)


def _get(f: h5py.File, path: str, name: str) -> Any:
    """``f.get(name)``, each external link on the way checked first: HDF5 opens the file it
    names, and opening a FIFO blocks (the whole process: h5py holds the GIL)."""
    parts = [p for p in name.split("/") if p]
    for k in range(len(parts)):
        link = f.get("/".join(parts[: k + 1]), getlink=True)
        if isinstance(link, h5py.ExternalLink):
            for target in _places(link.filename, path):
                _regular(target, path, name)
    return f.get(name)


def _regular(target: str, path: str, name: str) -> None:
    """Refuse a file the dataset ``name`` of ``path`` reaches that is there but is no regular
    file (a FIFO, socket, device or directory)."""
    if os.path.exists(target) and not os.path.isfile(target):
        raise DatasetError(
            path,
            f"reads {target!r}, not a regular file (a FIFO, socket, device or directory)",
            name,
        )


def _stamp(path: str) -> tuple[int, int, int, int] | None:
    """``(device, inode, size, mtime_ns)`` of ``path`` (``None``: not there), as
    ``file_stamp`` gives it for an open file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _chunks(ds: h5py.Dataset, drop: int) -> tuple[int, ...] | None:
    return None if ds.chunks is None else tuple(ds.chunks[drop:])


Layout = dict[str, tuple[np.dtype, tuple[int, ...]]]
"""``{dataset: (dtype, shape)}`` of one file, shapes whole (a sample axis included)."""


def _shapes(path: str) -> Layout:
    """The ``Layout`` of every non-scalar dataset in the file at ``path``."""
    with _open_file(path) as f:
        return {n: (d.dtype, d.shape) for n, d in _datasets(f, path, None).items() if d.ndim}


def _describe(layout: Layout) -> str:
    """``x <f4 (4, 8), y <f4 (4,)``, for messages."""
    return ", ".join(f"{n} {dt.str} {shape}" for n, (dt, shape) in layout.items()) or "nothing"


def _with_n(shape: tuple[int, ...]) -> str:
    """``(N, 4, 8)``: a per-sample shape with its sample axis, for messages."""
    return "(" + ", ".join(["N", *map(str, shape)]) + (",)" if not shape else ")")


def shard_count(path: str, got: Layout, want: Layout) -> int:
    """The samples in a shard file that holds ``got``: each dataset of ``want`` (``{name: (dtype,
    per-sample shape)}``) must be there with that dtype, and that shape after one leading
    sample axis whose length all of them share. The one rule for a file with a sample axis,
    for ``Hdf5Reader`` and for ``set_format``.

    Raises:
        DatasetError: naming the file and the field that breaks the rule.
    """
    count: tuple[str, int] | None = None
    for name, (dtype, shape) in want.items():
        if name not in got:
            raise DatasetError(path, "no such dataset in this shard", name)
        dt, whole = got[name]
        if dt != dtype or whole[1:] != shape or not whole:
            raise DatasetError(
                path,
                f"dataset {dt.str} {whole} differs from the first file's {dtype.str} "
                f"{_with_n(shape)}",
                name,
            )
        if count is None:
            count = (name, whole[0])
        elif whole[0] != count[1]:
            raise DatasetError(
                path,
                f"has {whole[0]} samples but field {count[0]!r} has {count[1]}; "
                "name the fields to read (fields=[...], or a spec's fields), or, if the file "
                'is one sample, say so (layout="per-sample")',
                name,
            )
    return 0 if count is None else count[1]


def set_format(files: list[str], look: int | None = 16, where: str | None = None) -> str:
    """How a set of several HDF5 files holds its samples: ``"hdf5"`` (shards) or
    ``"hdf5-per-sample"`` (one sample per file), decided from evidence in the files only.
    The rules, on every non-scalar dataset:

    1. Every file holds the same datasets with the same dtypes, else the first file that
       differs is named.
    2. Files of identical shapes hold one sample each when their datasets do not share one
       leading length (CosmoFlow's layout: ``full`` (128, 128, 128, 4) and ``unitPar`` (4,)):
       a shard's datasets all share its sample axis. When they do share one (``x`` (16, 4,
       32, 32, 32), ``y`` (16, 3)), the files could as well be shards of that many samples:
       the attribute ``LAYOUT_ATTR`` (``"per-sample"`` or ``"shards"``, which our writers
       set) decides, and without it the set is refused (``AmbiguousLayout``) with the one
       argument that states it (``layout=``).
    3. Files whose shapes differ are shards: in each file every dataset has one leading sample
       axis of the same length, and the same shape after it in every file (``shard_count``).
       A file that breaks this is named: the set is neither one sample per file nor shards
       (a one-sample file among shards, a trailing shape that differs); so is the first file
       unlike the others where the files state ``"per-sample"``.

    Judged on ``look`` files spread over the set, first and last included (``None``: every
    file); the readers check the rest (``Hdf5Reader`` when it opens, ``Hdf5PerSampleReader``
    when it reads a file or in ``check_files``). ``where``: the set's name in a refusal
    (its directory or glob). Default: the first file's directory.

    Raises:
        DatasetError: naming the first file that fits neither layout, or the set whose layout
            the files do not settle.
    """
    picked = files
    if look is not None and len(files) > look:
        at = sorted({round(i * (len(files) - 1) / (look - 1)) for i in range(look)})
        picked = [files[i] for i in at]
    layouts = [(path, _shapes(path)) for path in picked]
    first_path, first = layouts[0]
    for path, got in layouts[1:]:
        if set(got) != set(first) or any(got[n][0] != first[n][0] for n in first):
            raise DatasetError(
                path,
                f"holds {_describe(got)}, unlike the set's first file {first_path}: "
                f"{_describe(first)}; every file of a set holds the same datasets and dtypes",
            )
    if all(got == first for _, got in layouts):
        n = _leading_length(first)
        if n is None:
            return "hdf5-per-sample"
        stated = _stated_layout(picked)
        if stated is None:
            raise AmbiguousLayout(where or os.path.dirname(first_path), len(files), first, n)
        return FORMAT_OF_LAYOUT[stated]
    want = {n: (dt, shape[1:]) for n, (dt, shape) in first.items()}
    odd_path, odd = next((path, got) for path, got in layouts if got != first)
    if _stated_layout(picked) == "per-sample":
        raise DatasetError(
            odd_path,
            f"holds {_describe(odd)}, unlike the set's first file {first_path}: "
            f"{_describe(first)}; the files say they hold one sample each ({LAYOUT_ATTR}="
            "'per-sample'), and files of one sample each hold identical shapes",
        )
    try:
        shard_count(first_path, first, want)
    except DatasetError as exc:  # the first file is no shard: name the first one unlike it
        raise DatasetError(
            odd_path,
            f"holds {_describe(odd)}, unlike the set's first file {first_path}: "
            f"{_describe(first)}; files of one sample each hold identical shapes, and the "
            f"first file is no shard (field {exc.field!r}: {exc.reason})",
        ) from None
    for path, got in layouts[1:]:
        try:
            shard_count(path, got, want)
        except DatasetError as exc:
            raise DatasetError(
                path,
                f"holds {_describe(got)}, the set's first file {first_path}: "
                f"{_describe(first)}; the files are neither one sample each (identical "
                "shapes) nor shards (every dataset with one leading sample axis, the same "
                f"shapes after it): field {exc.field!r}: {exc.reason}",
            ) from None
    return "hdf5"


def _leading_length(layout: Layout) -> int | None:
    """The leading length every dataset of ``layout`` shares (``None`` if they do not): files
    of identical shapes with one could as well be shards of that many samples each."""
    lengths = {shape[0] for _, shape in layout.values()}
    return lengths.pop() if len(lengths) == 1 else None


class AmbiguousLayout(DatasetError):
    """A set of HDF5 files of identical shapes whose datasets share one leading length ``n``:
    one sample per file, or shards of ``n`` samples each. Names the set and the argument."""

    def __init__(self, where: str, files: int, layout: Layout, n: int):
        super().__init__(
            where,
            f"{files} HDF5 files of identical shapes ({_describe(layout)}): each could be one "
            f"sample, or a shard of {n} samples along axis 0, and no file says which; state it "
            f'with layout="shards" or layout="per-sample" (DataStoreLoader, open_dataset, '
            "datastore inspect --layout, datastore plan --layout), or with a spec file "
            '(format = "hdf5" or "hdf5-per-sample") for datastore serve and the trainer',
        )


def _stated_layout(files: list[str]) -> str | None:
    """The layout that the ``LAYOUT_ATTR`` attribute of ``files`` states (``None``: no file
    states one).

    Raises:
        DatasetError: a file that states none or another layout than the first, or a value
            other than ``LAYOUTS``.
    """
    stated = {}
    for path in files:
        with _open_file(path) as f:
            value = f.attrs.get(LAYOUT_ATTR)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if value is not None and value not in LAYOUTS:
            raise DatasetError(
                path, f"attribute {LAYOUT_ATTR}={value!r} is none of {', '.join(LAYOUTS)}"
            )
        stated[path] = value
    values = set(stated.values())
    if values == {None}:
        return None
    if len(values) > 1:
        odd = next(p for p, v in stated.items() if v != stated[files[0]])
        raise DatasetError(
            odd,
            f"attribute {LAYOUT_ATTR}={stated[odd]!r}, unlike the set's first file "
            f"{files[0]}: {stated[files[0]]!r}",
        )
    return values.pop()


class _FileCache:
    """A bounded LRU of open ``h5py.File`` s; used under the reader's lock only. A file whose
    ``file_stamp`` was taken when the dataset was opened (``stamps``) and differs when it is
    opened here (first, or again after it left the cache) is refused: replaced or rewritten,
    its samples may lie elsewhere now, or be others. ``confine`` (the reader's) is called with
    each file as opened, links resolved: a sample's file of a set of one sample per file, which
    has no stamp, linked out of the service's roots after the dataset was opened was served."""

    def __init__(
        self,
        limit: int,
        stamps: dict[str, tuple[int, int, int, int]],
        confine: Callable[[str], None] | None = None,
    ):
        self.limit, self.files, self.stamps, self.confine = limit, OrderedDict(), stamps, confine

    def get(self, path: str) -> h5py.File:
        f = self.files.get(path)
        if f is not None:
            self.files.move_to_end(path)
            return f
        f = _open_file(path)
        if self.confine is not None:
            try:
                self.confine(opened_path(f.id.get_vfd_handle()))
            except BaseException:
                f.close()
                raise
        want = self.stamps.get(path)
        if want is not None and file_stamp(f.id.get_vfd_handle()) != want:
            f.close()
            raise DatasetError(
                path,
                "changed since the dataset was opened (replaced or rewritten): open it again "
                "to read the new data",
            )
        self.files[path] = f
        while len(self.files) > self.limit:
            self.files.popitem(last=False)[1].close()
        return f

    def close(self) -> None:
        while self.files:
            self.files.popitem()[1].close()


class _Hdf5Base(Reader):
    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.stamps: dict[str, tuple[int, int, int, int]] = {}  # (filled where they are taken)

    def _open(self) -> _FileCache:
        return _FileCache(MAX_OPEN_FILES, self.stamps, self.confine)

    def _close(self, handles: _FileCache) -> None:
        handles.close()

    def release(self) -> None:
        """Close the open files (a later read opens them again): HDF5's lock on them refuses
        a writer, ``h5py.File(path, "w")`` included, for as long as they stay open."""
        with self._process_lock():
            if self._state is not None and self._state[0] == os.getpid():
                self._state[1].close()

    def _dataset(self, files: _FileCache, path: str, info: FieldInfo) -> h5py.Dataset:
        """``info``'s dataset in ``path``; only under ``self._lock``."""
        obj = _get(files.get(path), path, info.name)
        if not isinstance(obj, h5py.Dataset):
            raise DatasetError(path, "no such dataset in the file", info.name)
        seen = self.__dict__.setdefault("_reached", {})  # {(path, field): {file: stamp}}
        stamps = seen.get((path, info.name))
        if stamps is None:
            reached = reached_files(obj, path, self.confine)
            for f in reached:
                _regular(f, path, info.name)
                if self.confine is not None and os.path.exists(f):  # (none there: HDF5 looks on)
                    self.confine(f)
            stamps = seen[path, info.name] = {f: _stamp(f) for f in reached}
        for f, stamp in stamps.items():
            if _stamp(f) != stamp:
                raise DatasetError(
                    path,
                    f"{f}, which it reads, changed since the dataset was first read (replaced "
                    "or rewritten): open it again to read the new data",
                    info.name,
                )
        return obj

    def _names_asked(self) -> list[str] | None:
        return [f.name for f in self.spec.fields] or None


class Hdf5Reader(_Hdf5Base):
    """``hdf5``: fields are datasets with a leading sample axis; several files are shards whose
    samples follow each other in path order. Every field of a file has the same sample count.

    Attributes:
        offsets: ``int64`` array of ``len(files) + 1``: file ``k`` holds samples
            ``offsets[k]:offsets[k + 1]`` (``np.searchsorted`` finds a sample's file).
        stamps: each file's ``file_stamp`` when those were counted (a file opened with
            another is refused).
    """

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        counts = []
        for k, path in enumerate(self.files):
            with _open_file(path) as f:
                self.stamps[path] = file_stamp(f.id.get_vfd_handle())
                found = _datasets(f, path, self._names_asked() if k == 0 else list(self.fields))
                if k == 0:
                    available = self._first_file(path, found)
                    self._select_fields(available, path)
                    _check_filters(found, path, self.fields)
                got = {n: (ds.dtype, ds.shape) for n, ds in found.items()}
                want = {n: (fi.dtype, fi.shape) for n, fi in self._as_stored().items()}
                counts.append(shard_count(path, got, want))
                self.reached += [
                    r for n in self.fields for r in reached_files(found[n], path, self.confine)
                ]
        self.offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        self._length = int(self.offsets[-1])

    def _first_file(self, path: str, found: dict[str, h5py.Dataset]) -> dict[str, FieldInfo]:
        available = {}
        for name, ds in found.items():
            if ds.ndim == 0:
                if self.spec.fields:
                    raise DatasetError(path, "a scalar dataset has no sample axis", name)
                continue  # a file-level constant, not a field
            shape = tuple(ds.shape[1:])
            available[name] = FieldInfo(
                name, ds.dtype, shape, default_spatial_axes(len(shape)), _chunks(ds, 1)
            )
        return available

    def _locate(self, index: int) -> tuple[int, int]:
        """``(file, row)`` of sample ``index``."""
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return k, index - int(self.offsets[k])

    def _path_of(self, index: int) -> str:
        return self.files[self._locate(index)[0]]

    def _read_into(self, index: int, info: FieldInfo, sel: tuple[slice, ...], out: np.ndarray):
        k, local = self._locate(index)
        if self._read_raw(k, local, info, sel, out):  # plain bytes: no HDF5 call
            return
        files = self._handles()
        with self._lock:
            ds = self._dataset(files, self.files[k], info)
            ds.read_direct(out, source_sel=(local, *sel))

    def _layout(self, k: int, info: FieldInfo) -> tuple[str, Any, tuple[int, ...]] | None:
        """``_plain_layout`` of the field in file ``k``, with the file's ``file_stamp`` when the
        dataset was opened (h5py's open file has it: :class:`_FileCache` refuses another): a
        raw read of a file replaced or rewritten since is refused."""
        cache = self.__dict__.setdefault("_raw_layouts", {})
        key = (k, info.name)
        if key not in cache:
            path = self.files[k]
            with self._lock:
                layout = _plain_layout(self._dataset(self._handles(), path, info), path)
            cache[key] = None if layout is None else (*layout, self.stamps[path])
        return cache[key]

    def _chunk_offset(self, k: int, info: FieldInfo, origin: tuple[int, ...]) -> int | None:
        """File offset of the chunk at ``origin``; ``None`` if unallocated or filtered."""
        cache = self.__dict__.setdefault("_chunk_offsets", {})
        key = (k, info.name, origin)
        if key not in cache:
            with self._lock:
                ds = self._dataset(self._handles(), self.files[k], info)
                chunk = ds.id.get_chunk_info_by_coord(origin)
            plain = chunk.byte_offset is not None and chunk.filter_mask == 0
            cache[key] = chunk.byte_offset if plain else None
        return cache[key]

    def _read_raw(
        self, k: int, local: int, info: FieldInfo, sel: tuple[slice, ...], out: np.ndarray
    ) -> bool:
        """Read the box of sample ``local`` from the file's bytes when the dataset is stored
        plain (no filters, native byte order): a contiguous dataset at its data offset, a
        chunked one chunk by chunk (each chunk is a full-size C-ordered array on disk, edge
        chunks included). ``False``: h5py must read it."""
        layout = self._layout(k, info)
        if layout is None:
            return False
        kind, where, stamp = layout
        path = self.files[k]
        if kind == "contiguous":
            at = where + local * info.nbytes
            raw = RawArray(path, info.dtype, info.shape, False, offset=at, stamp=stamp)
            raw.read_into(out, sel)
            return True
        chunks = where
        box = [(local, local + 1)] + [(s.start, s.stop) for s in sel]
        spans = [range(lo // c, (hi - 1) // c + 1) for (lo, hi), c in zip(box, chunks, strict=True)]
        whole = out.reshape((1, *out.shape))
        for coords in itertools.product(*spans):
            origin = tuple(i * c for i, c in zip(coords, chunks, strict=True))
            offset = self._chunk_offset(k, info, origin)
            if offset is None:
                return False
            inter = [
                (max(lo, o), min(hi, o + c))
                for (lo, hi), o, c in zip(box, origin, chunks, strict=True)
            ]
            in_chunk = tuple(slice(a - o, b - o) for (a, b), o in zip(inter, origin, strict=True))
            in_out = tuple(
                slice(a - lo, b - lo) for (a, b), (lo, _) in zip(inter, box, strict=True)
            )
            target = whole[in_out]
            raw = RawArray(path, info.dtype, tuple(chunks), False, offset=offset, stamp=stamp)
            if target.flags.c_contiguous:
                raw.read_into(target, in_chunk)
            else:
                part = np.empty(target.shape, info.dtype)
                raw.read_into(part, in_chunk)
                target[...] = part
        return True


def _plain_layout(ds: h5py.Dataset, path: str) -> tuple[str, Any] | None:
    """``("contiguous", data offset)`` or ``("chunked", chunk shape)`` for a dataset of file
    ``path`` stored as plain bytes, else ``None``: filters, external storage, unallocated,
    non-numeric data, or a type other than the machine's own for its numpy dtype (another
    byte order, fewer bits of precision than its size, a bit offset), or a dataset in another
    file (an external link): h5py reads those."""
    plain = (
        ds.compression is None
        and not ds.shuffle
        and not ds.fletcher32
        and ds.scaleoffset is None
        and ds.dtype.kind in "biuf"
        and ds.dtype.isnative
        and ds.id.get_type().equal(h5t.py_create(ds.dtype))
        and not ds.external
        and _same_file(ds.file.filename, path)
    )
    if not plain:
        return None
    if ds.chunks is None:
        offset = ds.id.get_offset()
        return None if offset is None else ("contiguous", offset)
    return ("chunked", tuple(ds.chunks))


def reached_files(
    ds: h5py.Dataset,
    path: str,
    confine: Callable[[str], None] | None = None,
    _seen: set | None = None,
) -> list[str]:
    """The files besides ``path`` that reading ``ds`` (a dataset got from the file at
    ``path``) opens: the file an external link led to, external raw storage, a virtual
    dataset's sources, and what each source's dataset reads in turn (a source in the roots
    that was itself virtual, its own source outside, was served). A relative name is given
    as each place HDF5 may look for it (the file's directory, the working directory; a
    virtual source's: ``_source_places``). Each source file found is passed to ``confine``
    (a reader's), then opened once and its mapped datasets checked (``_check_mapping``): one
    outside ``datastore serve``'s roots is refused before it is opened."""
    own = ds.file.filename
    out = [] if _same_file(own, path) else [own]
    for name, _, _ in ds.external or ():
        out += _storage_places(os.fsdecode(name), own)
    if not ds.is_virtual:
        return out
    seen = set() if _seen is None else _seen
    found: dict[str, list[str]] = {}  # (one lookup per distinct source file)
    maps: dict[str, list[Any]] = {}  # {the place HDF5 opens: the mappings onto it}
    for m in ds.virtual_sources():
        if m.file_name == ".":
            places = [own]
        else:
            if m.file_name not in found:
                found[m.file_name] = _found_source(ds, m.file_name, own)
                out += found[m.file_name]
            places = found[m.file_name]
        maps.setdefault(places[-1], []).append(m)
    for place, mapped in maps.items():
        if os.path.isfile(place):
            out += _source_reaches(ds, place, mapped, path, seen, confine)
    return out


def _found_source(ds: h5py.Dataset, name: str, own: str) -> list[str]:
    """``_source_places`` of the virtual source ``name`` of ``ds`` (of the file ``own``).

    Raises:
        SourceMissing: naming ``own``, the dataset and the source, when the source is in
            none of those places: HDF5 reads its part as the fill value (zeros), silently.
            A name with ``%`` (a printf pattern HDF5 expands, ``%b``) is not checked.
    """
    places = _source_places(name, own)
    if "%" in name or os.path.exists(places[-1]):
        return places
    raise SourceMissing(
        own,
        f"its virtual source {name!r} is in none of the places HDF5 looks for it "
        f"({', '.join(dict.fromkeys(places))}): HDF5 would read its samples as the fill "
        "value; put the file there (or set HDF5_VDS_PREFIX to its directory)",
        ds.name.lstrip("/"),
        tuple(places),
    )


class SourceError(DatasetError):
    """A virtual dataset's source that HDF5 cannot read as mapped (no HDF5 file, its dataset
    of another dtype or shape): a change to the files at ``places`` (one put there, or
    rewritten) may mend it (a file of a set of one sample per file is refused when read,
    after the files the dataset reads were taken)."""

    def __init__(self, path: str, reason: str, field: str | None, places: tuple[str, ...]):
        super().__init__(path, reason, field)
        self.places = places

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason, self.field, self.places))


class SourceMissing(SourceError, DatasetMissing):
    """A virtual dataset's source in none of the ``places`` HDF5 looks for it, or lacking the
    mapped dataset there."""


def _source_reaches(
    ds: h5py.Dataset,
    place: str,
    mapped: list[Any],
    path: str,
    seen: set,
    confine: Callable[[str], None] | None,
) -> list[str]:
    """``reached_files`` of the datasets the mappings ``mapped`` of the virtual dataset ``ds``
    read in the source file ``place``, which ``confine`` is given first, each mapping checked
    (``_check_mapping``).

    Raises:
        SourceError: naming ``ds``'s file and field and the source, when the source cannot
            be opened as HDF5 (not an HDF5 file: the first read failed).
    """
    if confine is not None:
        confine(place)
    try:
        f = _open_file(place)
    except DatasetError as exc:
        raise SourceError(
            ds.file.filename,
            f"its virtual source {mapped[0].file_name!r} ({place}): {exc.reason}",
            ds.name.lstrip("/"),
            (place,),
        ) from None
    out: list[str] = []
    with f:
        for m in mapped:
            _check_mapping(ds, m, _source_dataset(f, m.dset_name), place)
        for name in dict.fromkeys(m.dset_name for m in mapped):
            key = (os.path.realpath(place), name)
            if key not in seen:
                seen.add(key)
                out += reached_files(f[name], path, confine, seen)
    return out


def _source_dataset(f: h5py.File, name: str) -> h5py.Dataset | None:
    try:
        obj = f.get(name)
    except (OSError, KeyError, ValueError):  # (a link in the source that leads nowhere)
        return None
    return obj if isinstance(obj, h5py.Dataset) else None


def _check_mapping(ds: h5py.Dataset, m: Any, source: h5py.Dataset | None, place: str) -> None:
    """Refuse the mapping ``m`` of the virtual dataset ``ds`` when the source file at ``place``
    lacks its dataset (``source`` None), holds it in a type HDF5 cannot convert to ``ds``'s
    (``_converts``: text or records into numbers), or of a shape the mapping does not fit
    (``_misfit``): HDF5 reads the first as the fill value, fails the second's read, and reads
    the third as the fill value or as other elements, or fails the read, without a word at
    open.

    Raises:
        SourceMissing: naming ``ds``'s file and field, the source file and dataset, when the
            dataset is not there.
        SourceError: so named, when its dtype or shape differ.
    """
    own, field = ds.file.filename, ds.name.lstrip("/")
    where = f"its virtual source {m.file_name!r} ({place})"
    if source is None:
        raise SourceMissing(
            own,
            f"{where} has no dataset {m.dset_name!r}: HDF5 would read its samples as the fill "
            "value",
            field,
            (place,),
        )
    held = f"holds {m.dset_name!r} as {source.dtype} {source.shape}"
    if not _converts(source.dtype, ds.dtype):
        raise SourceError(
            own,
            f"{where} {held}, which HDF5 cannot convert to the field's {ds.dtype}",
            field,
            (place,),
        )
    misfit = _misfit(m, source.shape)
    if misfit is not None:
        raise SourceError(own, f"{where} {held}, {misfit}", field, (place,))


def _converts(source: np.dtype, field: np.dtype) -> bool:
    """Whether HDF5 reads a virtual source of dtype ``source`` as ``field``: between numbers
    it converts as h5py reads it (int64 into float32 too); text or records into numbers not."""
    numbers = "biuf"
    return (source.kind in numbers and field.kind in numbers) or np.can_cast(source, field)


def _misfit(m: Any, shape: tuple[int, ...]) -> str | None:
    """How a source dataset of ``shape`` differs from what the virtual mapping ``m`` reads,
    ``None`` if it does not: for a whole source (HDF5 stores no shape for it), the block it
    fills (unit axes aside: a sample of a stack) or, for a mapping onto several blocks, as
    many elements; else a shape holding the source selection. A selection without end (an
    unlimited mapping) fits any."""
    src, dst = m.src_space, m.vspace
    if any(_unlimited(s) for s in (src, dst)) or dst.get_select_type() == h5s.SEL_NONE:
        return None
    if src.get_select_type() == h5s.SEL_ALL:
        lo, hi = dst.get_select_bounds()
        block = tuple(b - a + 1 for a, b in zip(lo, hi, strict=True))
        n = dst.get_select_npoints()
        if int(np.prod(block)) != n:
            fits = int(np.prod(shape)) == n
            return None if fits else f"not the {n} elements the virtual dataset maps from it"
        fits = [k for k in block if k != 1] == [k for k in shape if k != 1]
        return None if fits else f"not the {block} the virtual dataset maps from it"
    _, hi = src.get_select_bounds()
    if len(hi) == len(shape) and all(h < k for h, k in zip(hi, shape, strict=True)):
        return None
    return f"too small for the selection up to {tuple(h + 1 for h in hi)} mapped from it"


def _unlimited(space: h5s.SpaceID) -> bool:
    return (
        space.get_select_type() == h5s.SEL_HYPERSLABS
        and space.is_regular_hyperslab()
        and h5s.UNLIMITED in space.get_regular_hyperslab()[2]
    )


def _source_places(name: str, own: str) -> list[str]:
    """The places HDF5 looks for the virtual dataset source ``name`` of the file ``own``, in
    its order, up to the first that is there (it opens that one): ``name`` itself if absolute;
    then ``name`` (its last component, if absolute) under each directory of
    ``HDF5_VDS_PREFIX`` and under the whole of it (a leading ``${ORIGIN}``: ``own``'s
    directory), in ``own``'s directory, in the working directory, and in the directory of
    ``own`` with its links resolved (``H5Pset_virtual_prefix``; HDF5's
    ``H5F_prefix_open_file``)."""
    tail = os.path.basename(name) if os.path.isabs(name) else name
    here = os.path.dirname(os.path.abspath(own))
    places = [name] if os.path.isabs(name) else []
    prefix = os.environ.get("HDF5_VDS_PREFIX")
    if prefix is not None:
        places += [os.path.join(p, tail) for p in prefix.split(":") if p]
        if prefix.startswith("${ORIGIN}"):
            places.append(os.path.join(_origin_expanded(prefix, own), tail))
    places += [os.path.join(here, tail), os.path.abspath(tail)]
    places.append(os.path.join(os.path.dirname(os.path.realpath(own)), tail))
    for k, place in enumerate(places):
        if os.path.exists(place):
            return places[: k + 1]
    return places


def _storage_places(name: str, own: str) -> list[str]:
    """The places of the external raw storage file ``name`` of the file ``own``: ``_places``
    and, for a relative name, the one HDF5 reads under ``HDF5_EXTFILE_PREFIX`` (the whole of
    it; a leading ``${ORIGIN}``: ``own``'s directory), unchecked before: a file under the
    prefix outside the roots was served."""
    prefix = os.environ.get("HDF5_EXTFILE_PREFIX", "")
    if os.path.isabs(name) or prefix in ("", "."):
        return _places(name, own)
    return [*_places(name, own), os.path.join(_origin_expanded(prefix, own), name)]


def _origin_expanded(prefix: str, own: str) -> str:
    """``prefix`` with a leading ``${ORIGIN}`` read as HDF5 reads it: ``own``'s directory."""
    if not prefix.startswith("${ORIGIN}"):
        return prefix
    return os.path.dirname(os.path.abspath(own)) + prefix.removeprefix("${ORIGIN}")


def _places(name: str, own: str) -> list[str]:
    if os.path.isabs(name):
        return [name]
    return [os.path.join(os.path.dirname(os.path.abspath(own)), name), os.path.abspath(name)]


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class Hdf5PerSampleReader(_Hdf5Base):
    """``hdf5-per-sample``: file ``k`` (in path order) is sample ``k`` and holds every field as
    a dataset without a sample axis. Files after the first are checked as they are read."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        first = self.files[0]
        with _open_file(first) as f:
            found = _datasets(f, first, self._names_asked())
            available = {
                name: FieldInfo(
                    name, ds.dtype, ds.shape, default_spatial_axes(ds.ndim), _chunks(ds, 0)
                )
                for name, ds in found.items()
            }
            self._select_fields(available, first)
            _check_filters(found, first, self.fields)
            self.reached = [
                r for n in self.fields for r in reached_files(found[n], first, self.confine)
            ]
        self._length = len(self.files)

    def _path_of(self, index: int) -> str:
        return self.files[index]

    def _check(self, path: str, ds: h5py.Dataset, info: FieldInfo) -> None:
        if ds.dtype != info.dtype or ds.shape != info.shape:
            raise DatasetError(
                path,
                f"dataset {ds.dtype.str} {ds.shape} differs from the first file's "
                f"{info.dtype.str} {info.shape}",
                info.name,
            )

    def check_files(self) -> None:
        """Open every file and check that it holds the fields as the first file does."""
        for path in self.files[1:]:
            with _open_file(path) as f:
                found = _datasets(f, path, list(self.fields))
                for name, info in self._as_stored().items():
                    self._check(path, found[name], info)

    def _read_into(self, index: int, info: FieldInfo, sel: tuple[slice, ...], out: np.ndarray):
        path = self.files[index]
        files = self._handles()
        with self._lock:
            ds = self._dataset(files, path, info)
            self._check(path, ds, info)
            ds.read_direct(out, source_sel=sel if sel else None)


def _settle(files: list[str], where: str) -> str:
    """A set is shards or one sample per file (``set_format``); one file is ``hdf5`` unless its
    ``LAYOUT_ATTR`` says ``"per-sample"`` (a set of one sample, or a node's share of one)."""
    if len(files) > 1:
        return set_format(files, where=where)
    return FORMAT_OF_LAYOUT[_stated_layout(files) or "shards"]


_SUFFIXES = (".h5", ".hdf5")
register(
    Format(
        "hdf5", Hdf5Reader, suffixes=_SUFFIXES, settle=_settle, layouts=FORMAT_OF_LAYOUT,
        title="HDF5",
    )
)  # fmt: skip
register(Format("hdf5-per-sample", Hdf5PerSampleReader, suffixes=_SUFFIXES, detected=False))

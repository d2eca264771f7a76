"""The ``lmdb`` reader: datasets in the encoding of ``lmdb_format``, or any LMDB whose records a
spec's ``lmdb`` table describes (``lmdb_layout``; read by ``lmdb_records.SpecRecords``).

Each read is one read-only transaction with ``buffers=True``: the record is a view of LMDB's
memory map, copied (the region of it) into the caller's buffer before the transaction ends. An
uncompressed record is therefore read only where the region touches it (page granularity); a
record encoded by a codec is decoded whole, since a record is one value, and its region copied
out; so is a msgpack or pickle record. The environment (a directory holding ``data.mdb``, or
one file written with ``subdir=False``) is opened read-only without LMDB's lock
file, once per process and shared by the readers of that process (py-lmdb allows one open
per process); LMDB transactions are safe from several threads. A forked child closes the
environments it inherited and reopens its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lmdb
import numcodecs
import numpy as np
from numcodecs.compat import ensure_ndarray

from datastore.readers.base import DatasetError, FieldInfo, Reader
from datastore.readers.lmdb_format import META_KEY, parse_meta, sample_key
from datastore.readers.lmdb_records import SpecRecords
from datastore.readers.registry import Format, register, resolve_paths
from staging.confine import open_regular, opened_path

if TYPE_CHECKING:
    from datastore.readers.spec import DatasetSpec

__all__ = ["LmdbReader"]


MAX_DBS = 256  # named databases an environment may hold and a reader open
NAMES_SHOWN = 8  # named databases a message lists

# py-lmdb opens an environment once per process: readers of the same one share it, counted.
_envs: dict[str, list[Any]] = {}  # real path -> [Environment, users]
_envs_lock = threading.Lock()


def _acquire_env(path: str, confine: Callable[[str], None] | None = None) -> lmdb.Environment:
    key = os.path.realpath(path)
    with _envs_lock:
        entry = _envs.get(key)
        if entry is None:
            try:
                env = _open_env(path) if confine is None else _open_confined(path, confine)
            except lmdb.Error as exc:
                raise DatasetError(path, f"not a readable LMDB environment: {exc}") from None
            entry = _envs[key] = [env, 0]
        entry[1] += 1
        return entry[0]


def _open_env(path: str, subdir: bool | None = None) -> lmdb.Environment:
    return lmdb.open(
        path,
        readonly=True,
        lock=False,
        readahead=False,
        subdir=os.path.isdir(path) if subdir is None else subdir,
        max_readers=1024,
        max_dbs=MAX_DBS,
    )


def _open_confined(path: str, confine: Callable[[str], None]) -> lmdb.Environment:
    """The environment at ``path`` mapped from the data file checked by ``confine`` as opened,
    links resolved (``data.mdb`` linked out of the service's roots after the dataset was
    opened was served)."""
    data = os.path.join(path, "data.mdb") if os.path.isdir(path) else path
    fd = open_regular(data)
    try:
        confine(opened_path(fd))
        return _open_env(f"/proc/self/fd/{fd}", subdir=False)  # the file checked (no lock file)
    finally:
        os.close(fd)


def _release_env(path: str) -> None:
    key = os.path.realpath(path)
    with _envs_lock:
        entry = _envs.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _envs[key]
                entry[0].close()


def _after_fork_in_child() -> None:
    """LMDB environments must not be used across fork: the child closes what it inherited
    (its own copies of the maps and descriptors), and its readers reopen on first use."""
    global _envs_lock
    _envs_lock = threading.Lock()
    inherited = list(_envs.values())
    _envs.clear()
    for env, _ in inherited:
        env.close()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LmdbReader(Reader):
    """``lmdb``: fields, dtypes, shapes, spatial axes and codecs come from ``__meta__``, or,
    with a spec's ``lmdb`` table, from the table and the first record."""

    def __init__(self, spec: DatasetSpec):
        super().__init__(spec)
        self.files = resolve_paths(spec)
        root = self.files[0]
        self._records: SpecRecords | None = None
        self._codecs: dict[str, dict[str, Any] | None] = {}
        self._db_name = spec.lmdb.db if spec.lmdb is not None else None
        env = _acquire_env(root)
        try:
            with env.begin(db=self._database(env), buffers=True) as txn:
                if spec.lmdb is not None:
                    self._records = SpecRecords(spec.lmdb, txn, root)
                    available, n = self._records.fields, len(self._records)
                else:
                    meta = txn.get(META_KEY)
                    if meta is None:
                        _say_if_named(env, root)
                    n, metas = parse_meta(meta, root)
                    available = {
                        name: FieldInfo(name, m.dtype, m.shape, m.spatial_axes, None)
                        for name, m in metas.items()
                    }
                    self._codecs = {name: m.codec for name, m in metas.items()}
        except lmdb.Error as exc:
            raise DatasetError(root, f"cannot read the environment: {exc}") from None
        finally:
            _release_env(root)
        self._select_fields(available, root)
        self._codecs = {name: self._codecs.get(name) for name in self.fields}
        self._length = n

    def _database(self, env: lmdb.Environment) -> Any:
        """The handle of the named database the spec's ``db`` names (``None``: the main one)."""
        if self._db_name is None:
            return None
        try:
            return env.open_db(self._db_name.encode(), create=False)
        except lmdb.NotFoundError:
            names = _shown(_named(env)) or "none"
            raise DatasetError(
                self.files[0], f"no database named {self._db_name!r} (named databases: {names})"
            ) from None
        except lmdb.IncompatibleError:
            raise DatasetError(
                self.files[0], f"key {self._db_name!r} of the main database is no database"
            ) from None
        except lmdb.DbsFullError:
            raise DatasetError(
                self.files[0], f"more than {MAX_DBS} named databases opened in this process"
            ) from None

    @property
    def codecs(self) -> dict[str, dict[str, Any] | None]:
        """``{field: numcodecs config or None}``."""
        return dict(self._codecs)

    def check_files(self) -> None:
        """With a spec's ``lmdb`` table: every raw record's size, every npy record's header."""
        if self._records is None:
            return
        env, _, db = self._handles()
        try:
            with env.begin(db=db, buffers=True) as txn:
                self._records.check_all(txn)
        except lmdb.Error as exc:
            raise DatasetError(self.files[0], f"cannot read the environment: {exc}") from None

    def _open(self) -> tuple[lmdb.Environment, dict[str, Any], Any]:
        codecs = {
            k: None if c is None else numcodecs.get_codec(dict(c)) for k, c in self._codecs.items()
        }
        env = _acquire_env(self.files[0], self.confine)
        return env, codecs, self._database(env)

    def _close(self, handles: tuple[lmdb.Environment, dict[str, Any], Any]) -> None:
        _release_env(self.files[0])

    def _read_into(self, index: int, info: FieldInfo, sel: tuple[slice, ...], out: np.ndarray):
        env, codecs, db = self._handles()
        root, codec = self.files[0], codecs[info.name]
        records = self._records
        key = sample_key(index, info.name) if records is None else records.keys[index]
        with env.begin(db=db, buffers=True) as txn:
            buf = txn.get(key)
            if buf is None:
                raise DatasetError(root, f"no record for sample {index} (key {key!r})", info.name)
            if records is not None:  # raw, npy: a view of the map; msgpack, pickle: decoded
                np.copyto(out, records.array(buf, info, key)[sel])
                return
            if codec is None:  # a view of the memory map: only the region's pages are read
                np.copyto(out, self._as_array(buf, info, root, index)[sel])
                return
            try:
                raw = ensure_ndarray(codec.decode(buf))
            except (ValueError, RuntimeError, TypeError) as exc:
                raise DatasetError(
                    root, f"sample {index}: cannot decode the record: {exc}", info.name
                ) from None
        np.copyto(out, self._as_array(raw, info, root, index)[sel])

    @staticmethod
    def _as_array(buf: Any, info: FieldInfo, root: str, index: int) -> np.ndarray:
        data = np.frombuffer(buf, dtype=np.uint8)
        if data.size != info.nbytes:
            raise DatasetError(
                root,
                f"sample {index}: record holds {data.size} bytes, the field needs {info.nbytes}",
                info.name,
            )
        return data.view(info.dtype).reshape(info.shape)


def _named(env: lmdb.Environment) -> list[str]:
    """The named databases of ``env`` (the keys of its main database that open as one)."""
    names = []
    with env.begin() as txn:
        for key in txn.cursor().iternext(values=False):
            try:
                env.open_db(bytes(key), create=False)
            except (lmdb.IncompatibleError, lmdb.NotFoundError):
                return []  # a record: the main database holds data, not databases
            except lmdb.DbsFullError:  # more than MAX_DBS: the first ones say enough
                break
            names.append(bytes(key).decode(errors="backslashreplace"))
    return names


def _shown(names: list[str]) -> str:
    """The first ``NAMES_SHOWN`` of ``names``, for a message."""
    return ", ".join(names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")


def _say_if_named(env: lmdb.Environment, root: str) -> None:
    """Raise, naming them, when the main database holds only named databases (it stops at
    its first record otherwise)."""
    names = _named(env)
    if names:
        raise DatasetError(
            root,
            f"holds named databases ({_shown(names)}), no __meta__ record: name the one to read "
            f'with db = "{names[0]}" in a spec file\'s lmdb table, which also says how its '
            "records are encoded (docs/loader.md, Spec files)",
        )


def _is_environment(path: str) -> bool:
    """Whether the directory ``path`` holds an LMDB environment (``data.mdb``)."""
    return os.path.exists(os.path.join(path, "data.mdb"))


register(Format("lmdb", LmdbReader, whole=True, marker=_is_environment, title="LMDB"))

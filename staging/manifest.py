"""The manifest inside DEST: what was staged, from where, and its checksum.

Layout of ``DEST/.datastore/``:

- ``manifest.json``: the compacted manifest, replaced atomically at the end of each run.
- ``journal-<rank>.jsonl``: entries appended by each rank while it stages, one JSON object a
  line, so that a run killed at any point keeps what it finished. Loading applies the journals
  on top of ``manifest.json``; compaction folds them in and deletes them.
- ``tmp/``: files being written, never under their final name; only the stage holding
  ``lock`` writes there or clears it (``stage.clean_tmp``).
- ``lock``: held (``flock``) by the node's leader for the whole run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from staging.checksum import LEAF_BYTES

__all__ = ["META", "Journal", "Manifest", "lock_dest", "meta_dir", "open_meta", "same_meta"]

META = ".datastore"
VERSION = 1
ENTRY_KEYS = {"kind", "source", "ident", "size", "hash"}  # what every entry has


def meta_dir(dest: str) -> str:
    return os.path.join(dest, META)


def open_meta(dest: str, doing: str = "write") -> int:
    """A descriptor of ``DEST/.datastore``, opened from DEST's and never through a link: one
    there, dangling too, is ``EPERM``, named, refusing to ``doing`` through it (by path, a link
    to another DEST's had the run empty that one's ``tmp/`` and write its manifest there). The
    caller closes it."""
    top = os.open(dest, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return os.open(
            META, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top
        )
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(meta_dir(dest)):
            why = f"refusing to {doing} through a symlink: {meta_dir(dest)}"
            raise OSError(errno.EPERM, why) from None  # (named in why)
        raise
    finally:
        os.close(top)


def same_meta(dest: str, meta: int) -> None:
    """Raise ``OSError`` naming ``DEST/.datastore`` where it is no longer the directory open
    as ``meta``: a link now (``EPERM``), or another directory moved there."""
    fd = open_meta(dest)
    try:
        now, held = os.fstat(fd), os.fstat(meta)
    finally:
        os.close(fd)
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        why = f"replaced while the stage ran: {meta_dir(dest)}"
        raise OSError(errno.ESTALE, why)


@contextlib.contextmanager
def _opened(dest: str, meta: int | None) -> Iterator[int]:
    """``meta``, or DEST's ``.datastore`` opened (:func:`open_meta`) and closed on leaving."""
    if meta is not None:
        yield meta
        return
    fd = open_meta(dest)
    try:
        yield fd
    finally:
        os.close(fd)


def _at(meta: int) -> Any:
    """An ``opener`` of the files of the directory ``meta``, never through a link: one there
    is ``EPERM``, named (it was 'Too many levels of symbolic links', naming nothing)."""

    def opener(name: str, flags: int) -> int:
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=meta)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            where = os.path.join(os.readlink(f"/proc/self/fd/{meta}"), name)
            raise OSError(errno.EPERM, f"refusing to open through a symlink: {where}") from None

    return opener


@dataclass
class Manifest:
    """Entries keyed by DEST-relative path, plus archive records and the shard this node holds.

    An entry: ``{"kind", "source", "ident", "size", "hash"}`` (``hash`` is ``None`` for
    directories and symlinks, whose ``link`` is kept instead). An archive record:
    ``{"ident", "members": [dest, ...]}``.
    """

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    archives: dict[str, dict[str, Any]] = field(default_factory=dict)
    shard: dict[str, Any] | None = None
    leaf_bytes: int = LEAF_BYTES

    @classmethod
    def load(cls, dest: str, meta: int | None = None) -> Manifest:
        """Read ``manifest.json`` and apply every journal; a torn last journal line is ignored.
        ``meta``: DEST's ``.datastore`` open (:func:`open_meta`); else opened here, and a DEST
        without one has an empty manifest."""
        if meta is None and not os.path.lexists(meta_dir(dest)):
            return cls()
        with _opened(dest, meta) as fd:
            return cls._read(fd, os.path.join(meta_dir(dest), "manifest.json"))

    @classmethod
    def _read(cls, meta: int, path: str) -> Manifest:
        """:meth:`load` from the directory ``meta``; ``path`` names its manifest in errors."""
        m = cls()
        with contextlib.suppress(FileNotFoundError):
            try:
                with open("manifest.json", encoding="utf-8", opener=_at(meta)) as f:
                    doc = json.load(f)
            except ValueError as exc:  # JSON or UTF-8: a manifest someone else wrote over
                raise ValueError(f"{path}: corrupt manifest ({exc})") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("entries", {}), dict):
                raise ValueError(f"{path}: corrupt manifest (not a datastore manifest)")
            if doc.get("version") != VERSION:
                raise ValueError(f"{path}: unsupported manifest version {doc.get('version')!r}")
            m.entries, m.archives = doc.get("entries", {}), doc.get("archives", {})
            for name, entry in m.entries.items():
                if not (isinstance(entry, dict) and entry.keys() >= ENTRY_KEYS):
                    raise ValueError(f"{path}: corrupt manifest (entry {name!r} is not an entry)")
            if not isinstance(m.archives, dict) or not all(
                isinstance(a, dict) for a in m.archives.values()
            ):
                raise ValueError(f"{path}: corrupt manifest (archives are not archive records)")
            m.shard = doc.get("shard")
            m.leaf_bytes = doc.get("leaf_bytes", LEAF_BYTES)
        for name in sorted(fnmatch.filter(os.listdir(meta), "journal-*.jsonl")):
            with open(name, opener=_at(meta)) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        break  # the line a kill -9 cut short
                    m.apply(rec)
        return m

    def apply(self, rec: dict[str, Any]) -> None:
        """Apply one journal record: ``{"entry": path, ...}`` or ``{"archive": path, ...}``."""
        if "entry" in rec:
            self.entries[rec["entry"]] = {k: v for k, v in rec.items() if k != "entry"}
        elif "archive" in rec:
            self.archives[rec["archive"]] = {k: v for k, v in rec.items() if k != "archive"}

    def save(self, dest: str, meta: int | None = None) -> None:
        """Write ``manifest.json`` atomically (temp, fsync, rename) and drop the journals;
        ``meta`` as for :meth:`load`."""
        with _opened(dest, meta) as fd:
            self._write(fd)

    def _write(self, meta: int) -> None:
        doc = {
            "version": VERSION,
            "leaf_bytes": self.leaf_bytes,
            "shard": self.shard,
            "entries": dict(sorted(self.entries.items())),
            "archives": self.archives,
        }
        with open("manifest.json.tmp", "w", opener=_at(meta)) as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace("manifest.json.tmp", "manifest.json", src_dir_fd=meta, dst_dir_fd=meta)
        for name in fnmatch.filter(os.listdir(meta), "journal-*.jsonl"):
            os.unlink(name, dir_fd=meta)
        os.fsync(meta)


class Journal:
    """Append-only journal of one rank; ``write`` many records, then ``flush`` them at once:
    all reach the file, or none (a torn line would hide every later record from ``load``)."""

    def __init__(self, dest: str, rank: int, meta: int | None = None):
        with _opened(dest, meta) as fd:
            self._fd = _at(fd)(f"journal-{rank}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._lines: list[str] = []

    def write(self, rec: dict[str, Any]) -> None:
        self._lines.append(json.dumps(rec, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        """Append the records written since the last flush; ``OSError`` (a full disk) leaves
        the file as it was."""
        data, self._lines = memoryview("".join(self._lines).encode()), []
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:
            os.ftruncate(self._fd, end)
            raise

    def close(self) -> None:
        os.close(self._fd)


def lock_dest(dest: str, meta: int | None = None) -> int:
    """Take DEST's exclusive staging lock; ``BlockingIOError`` if another run holds it;
    ``meta`` as for :meth:`Manifest.load`."""
    with _opened(dest, meta) as dir_fd:
        fd = _at(dir_fd)("lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    return fd

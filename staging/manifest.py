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

import fcntl
import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from staging.checksum import LEAF_BYTES
from staging.durable import fsync_dir

__all__ = ["META", "Journal", "Manifest", "lock_dest", "meta_dir"]

META = ".datastore"
VERSION = 1
ENTRY_KEYS = {"kind", "source", "ident", "size", "hash"}  # what every entry has


def meta_dir(dest: str) -> str:
    return os.path.join(dest, META)


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
    def load(cls, dest: str) -> Manifest:
        """Read ``manifest.json`` and apply every journal; a torn last journal line is ignored."""
        m = cls()
        path = os.path.join(meta_dir(dest), "manifest.json")
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
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
        for jpath in sorted(glob.glob(os.path.join(meta_dir(dest), "journal-*.jsonl"))):
            with open(jpath) as f:
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

    def save(self, dest: str) -> None:
        """Write ``manifest.json`` atomically (temp, fsync, rename) and drop the journals."""
        meta = meta_dir(dest)
        doc = {
            "version": VERSION,
            "leaf_bytes": self.leaf_bytes,
            "shard": self.shard,
            "entries": dict(sorted(self.entries.items())),
            "archives": self.archives,
        }
        tmp = os.path.join(meta, "manifest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(meta, "manifest.json"))
        for jpath in glob.glob(os.path.join(meta, "journal-*.jsonl")):
            os.unlink(jpath)
        fsync_dir(meta)


class Journal:
    """Append-only journal of one rank; ``write`` many records, then ``flush`` them at once:
    all reach the file, or none (a torn line would hide every later record from ``load``)."""

    def __init__(self, dest: str, rank: int):
        path = os.path.join(meta_dir(dest), f"journal-{rank}.jsonl")
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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


def lock_dest(dest: str) -> int:
    """Take DEST's exclusive staging lock; ``BlockingIOError`` if another run holds it."""
    fd = os.open(os.path.join(meta_dir(dest), "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    return fd

"""What a resident dataset's files look like on disk, to notice when they change.

A service keeps a dataset in memory across the jobs of a campaign; a campaign that stages new
data to the same path (``datastore stage`` writes new files and renames them into place, ``cp``
rewrites them) must not be served the old copy. :func:`files_state` digests every file's size,
modification and change times and inode (the files inside a directory dataset, such as a Zarr
store, included, but for LMDB's lock file and NFS's ``.nfs*``): one ``stat`` per file, no byte
read. The change time is the one a copy cannot set: ``cp -p`` of a file of the same size and
modification time (archives' fixed times) rewrites it in place, the same inode.
:func:`dataset_paths` adds what the dataset's path names now, so that a file added to its
directory or glob, or a spec file edited, counts as a change too.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Mapping, Sequence

from datastore.readers.base import DatasetError
from datastore.readers.spec import SPEC_SUFFIXES, DatasetSpec

__all__ = ["dataset_paths", "files_state", "files_stats"]


def files_state(paths: Sequence[str], seen: Mapping[str, str] | None = None) -> bytes:
    """A digest of the size, modification and change times and inode of every file under
    ``paths`` (a file, or a directory walked whole); a path that cannot be read counts as its
    error. ``seen``: those read before (:func:`files_stats`), for the files it holds."""
    seen = seen or {}
    h = hashlib.blake2b(digest_size=16)
    for name in sorted({name for path in paths for name in _files(path)}):
        stat = seen[name] if name in seen else _stat(name)
        h.update(f"{name}\0{stat}\0".encode("utf-8", "surrogateescape"))
    return h.digest()


def files_stats(paths: Sequence[str]) -> dict[str, str]:
    """What :func:`files_state` digests of each file under ``paths``, by name: taken before a
    dataset is opened, so that a file changed or added while it opens counts as a change."""
    return {name: _stat(name) for path in paths for name in _files(path)}


def dataset_paths(path: str) -> list[str]:
    """What the dataset path ``path`` names now: a glob's matches, a directory's entries
    (those starting with ``.`` left out, as the readers leave them: staging's ``.datastore``),
    else the path itself; for a spec file, also what its paths name (a spec that no longer
    parses: the file alone, whose change is seen)."""
    if not path.lower().endswith(SPEC_SUFFIXES):
        return _named(path)
    try:
        spec = DatasetSpec.load(path)
    except DatasetError:
        return [path]
    return [path, *(n for p in spec.paths for n in _named(p))]


def _named(path: str) -> list[str]:
    if any(c in path for c in "*?["):
        return sorted(glob.glob(path))
    try:
        names = sorted(os.listdir(path)) if os.path.isdir(path) else None
    except OSError:
        names = None
    if names is None:
        return [path]
    return [os.path.join(path, n) for n in names if not n.startswith(".")]


def _files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        out += [os.path.join(root, name) for name in sorted(files) if not _unread(name)]
    return out


def _unread(name: str) -> bool:
    """Files of a directory dataset that are not its data: LMDB's lock file (rewritten by any
    process that opens the environment), NFS's ``.nfs*`` of files deleted while open. (Zarr's
    ``.zarray`` and the like are data.)"""
    return name == "lock.mdb" or name.startswith(".nfs")


def _stat(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"error {exc.errno}"
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"

"""What a resident dataset's files look like on disk, to notice when they change.

A service keeps a dataset in memory across the jobs of a campaign; a campaign that stages new
data to the same path (``datastore stage`` writes new files and renames them into place, ``cp``
rewrites them) must not be served the old copy. :func:`files_state` digests every file's size,
modification time and inode (the files inside a directory dataset, such as a Zarr store,
included, but for LMDB's lock file and NFS's ``.nfs*``): one ``stat`` per file, no byte read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

__all__ = ["files_state"]


def files_state(paths: Sequence[str]) -> bytes:
    """A digest of the size, modification time and inode of every file under ``paths`` (a
    file, or a directory walked whole); a path that cannot be read counts as its error."""
    h = hashlib.blake2b(digest_size=16)
    for path in paths:
        for name in _files(path):
            h.update(f"{name}\0{_stat(name)}\0".encode("utf-8", "surrogateescape"))
    return h.digest()


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
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"

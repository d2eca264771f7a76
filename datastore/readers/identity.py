"""Which data a dataset is, for a resumed loader to tell it from another of the same size.

:func:`identity` digests every file's name (relative to the dataset's directory), and the size
and modification time (to the nanosecond: two datasets written by one script within a second
differ there) of up to :data:`STATS` of them, evenly spaced: no byte is read, and a set of a
million per-sample files costs every rank :data:`STATS` ``stat`` calls, not a million (on a
parallel file system each is a metadata server's round trip). A copy that keeps them
(``datastore stage``, ``cp -a``, ``rsync -a``) is the same dataset at another path; other files
of the same shapes, or bytes written since into a file it stats, are another (so is a copy that
does not keep the times: ``cp -r``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

__all__ = ["STATS", "identity"]

STATS = 4096  # files whose size and time are taken, at most


def identity(files: Sequence[str]) -> str:
    """A digest of the names (relative to the files' common directory; a directory's files
    walked) of ``files``, in their order (the order of the samples), and of the sizes and
    modification times of :data:`STATS` of them, evenly spaced (all where there are no more);
    a file that cannot be read counts as its error."""
    paths = [f if os.path.isabs(f) else os.path.abspath(f) for f in map(os.fspath, files)]
    if not paths:
        return ""
    dirs = os.path.isdir(paths[0])  # a dataset's paths are all files or all directories
    one_dir = dirs and len(paths) == 1
    root = paths[0] if one_dir else os.path.commonpath(list({os.path.dirname(p) for p in paths}))
    names = list(dict.fromkeys(n for p in paths for n in _walk(p))) if dirs else paths
    prefix = os.path.join(root, "")
    h = hashlib.blake2b(digest_size=8)
    stride = -(-len(names) // STATS)
    for k, name in enumerate(names):
        rel = name[len(prefix) :] if name.startswith(prefix) else os.path.relpath(name, root)
        entry = f"{rel}\0{_stat(name) if k % stride == 0 else ''}\0"
        h.update(entry.encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _walk(path: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # staging's .datastore
        # LMDB's lock file is rewritten by whoever opens the environment
        out += [
            os.path.join(root, n)
            for n in sorted(files)
            if n != "lock.mdb" and not n.startswith(".")
        ]
    return out


def _stat(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError as exc:
        return type(exc).__name__
    return f"{st.st_size} {st.st_mtime_ns}"

"""Which data a dataset is, for a resumed loader to tell it from another of the same size.

:func:`identity` digests every file's name (relative to the dataset's directory), size and
modification time (to the nanosecond: two datasets written by one script within a second
differ there): no byte is read. A copy that keeps them (``datastore stage``, ``cp -a``,
``rsync -a``) is the same dataset at another path; other bytes written since, or other files of
the same shapes, are another (so is a copy that does not keep the times: ``cp -r``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

__all__ = ["identity"]


def identity(files: Sequence[str]) -> str:
    """A digest of the names (relative to the files' common directory; a directory's files
    walked), sizes and modification times of ``files``, in their order (the order of the
    samples); a file that cannot be read counts as its error."""
    paths = [os.path.abspath(f) for f in files]
    if not paths:
        return ""
    one_dir = len(paths) == 1 and os.path.isdir(paths[0])
    root = paths[0] if one_dir else os.path.commonpath([os.path.dirname(p) for p in paths])
    h = hashlib.blake2b(digest_size=8)
    for name in dict.fromkeys(name for path in paths for name in _walk(path)):
        entry = f"{os.path.relpath(name, root)}\0{_stat(name)}\0"
        h.update(entry.encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _walk(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
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

"""DEST's temp space (``DEST/.datastore/tmp``), cleared by a stage that holds DEST's lock.

A run resumes only the partial copies of large files (``KEY.part`` with its leaf log
``KEY.leaves``), moved to where this version looks for them; everything else an interrupted or
older stage left goes, links removed and never followed, and the space freed is counted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from staging.copy import tmp_subdir
from staging.manifest import META

__all__ = ["Freed", "clean_tmp", "drop_partials"]

PARTIAL = re.compile(r"([0-9a-f]{20})\.(part|leaves)")
"""A partial copy of a large file is ``KEY.part`` with its leaf log ``KEY.leaves`` beside it."""
TMP = os.path.join(META, "tmp")  # DEST's name of its temp space


@dataclass
class Freed:
    """Temp files removed from DEST and the disk space they held (their allocated blocks)."""

    files: int = 0
    bytes: int = 0


def clean_tmp(meta: int) -> Freed:
    """Clear the temp space of DEST's ``.datastore``, open as ``meta`` (its lock held):
    everything under ``tmp/`` goes but the partial copies a re-run resumes, which move to where
    this version looks for them (``tmp/K/KEY.part`` and ``.leaves``; older versions left them
    in ``tmp/`` itself or in ``tmp/KK/``). Links are removed, never followed."""
    freed = Freed()
    try:
        top = _opendir("tmp", meta)
    except FileNotFoundError:
        return freed
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        _remove(meta, "tmp", freed)  # a file or a link where tmp/ belongs
        return freed
    try:
        subdirs = [n for n in os.listdir(top) if _is_dir(top, n)]
        pairs = [("", k) for k in _sweep(top, set(subdirs), freed)]  # (subdirectory, key)
        for sub in subdirs:
            fd = _opendir(sub, top)
            try:
                pairs += [(sub, k) for k in _sweep(fd, set(), freed)]
            finally:
                os.close(fd)
        placed = {k for sub, k in pairs if sub == tmp_subdir(k)}
        for sub, key in pairs:
            if sub != tmp_subdir(key):
                _move_partial(top, sub, key, placed, freed)
        for sub in subdirs:
            with contextlib.suppress(OSError):  # not empty: it holds a partial copy
                os.rmdir(sub, dir_fd=top)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir("tmp", dir_fd=meta)
    return freed


def drop_partials(meta: int, wanted: set[str]) -> Freed:
    """Remove the partial copies whose leaf log's first line (``source ident algo``) is not in
    ``wanted``: what this run is not going to resume. Touches nothing else under ``tmp/`` of
    DEST's ``.datastore``, open as ``meta`` (the members written ahead of the plan are there
    by now); a link there is ``EPERM`` (by path, another DEST's partial copies went)."""
    freed = Freed()
    try:
        tmp = _opendir("tmp", meta)
    except FileNotFoundError:
        return freed
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP) or not _is_link(meta, "tmp"):
            raise
        raise OSError(errno.EPERM, "refusing to write through a symlink", TMP) from None
    try:
        for sub in [n for n in os.listdir(tmp) if _is_dir(tmp, n)]:
            fd = _opendir(sub, tmp)
            try:
                for key in _partials(fd):
                    with open(f"{key}.leaves", "rb", opener=_at(fd)) as f:
                        ident = f.readline().rstrip(b"\n")
                    if os.fsdecode(ident) not in wanted:
                        _remove(fd, f"{key}.part", freed)
                        _remove(fd, f"{key}.leaves", freed)
            finally:
                os.close(fd)
    finally:
        os.close(tmp)
    return freed


def _sweep(fd: int, keep: set[str], freed: Freed) -> set[str]:
    """Remove everything in directory ``fd`` but the names in ``keep`` and the partial copies;
    returns the keys of those."""
    keys = _partials(fd)
    for name in os.listdir(fd):
        m = PARTIAL.fullmatch(name)
        if not (m and m[1] in keys) and name not in keep:
            _remove(fd, name, freed)
    return keys


def _partials(fd: int) -> set[str]:
    """The keys of the partial copies in directory ``fd``: a regular ``.part`` and ``.leaves``."""
    found: dict[str, set[str]] = {}
    for e in os.scandir(fd):
        m = PARTIAL.fullmatch(e.name)
        if m and e.is_file(follow_symlinks=False):
            found.setdefault(m[1], set()).add(m[2])
    return {k for k, exts in found.items() if len(exts) == 2}


def _move_partial(top: int, sub: str, key: str, placed: set[str], freed: Freed) -> None:
    """Move the partial copy ``key`` from ``tmp/sub`` to its place in this version's layout,
    or remove it where a copy of this version is there already (the newer of the two)."""
    src = _opendir(sub, top) if sub else top
    try:
        if key in placed:
            _remove(src, f"{key}.part", freed)
            _remove(src, f"{key}.leaves", freed)
            return
        to = tmp_subdir(key)
        with contextlib.suppress(FileExistsError):
            os.mkdir(to, dir_fd=top)
        dst = _opendir(to, top)
        try:
            for ext in ("part", "leaves"):
                name = f"{key}.{ext}"
                os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
        finally:
            os.close(dst)
        placed.add(key)
    finally:
        if sub:
            os.close(src)


def _opendir(name: str, dir_fd: int | None) -> int:
    """Open directory ``name`` (in directory ``dir_fd``), never through a link."""
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)


def _is_dir(fd: int, name: str) -> bool:
    return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)


def _is_link(fd: int, name: str) -> bool:
    return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)


def _at(fd: int) -> Any:
    return lambda name, flags: os.open(name, flags | os.O_NOFOLLOW, dir_fd=fd)


def _remove(fd: int, name: str, freed: Freed) -> None:
    """Remove ``name`` in directory ``fd``, a directory with all it holds, counting into
    ``freed`` each file and the blocks that go with it (none for a file linked elsewhere too)."""
    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        sub = _opendir(name, fd)
        try:
            for child in os.listdir(sub):
                _remove(sub, child, freed)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=fd)
        return
    os.unlink(name, dir_fd=fd)
    freed.files += 1
    if st.st_nlink == 1 and stat.S_ISREG(st.st_mode):
        freed.bytes += st.st_blocks * 512

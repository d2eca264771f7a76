"""Confining a stage's reads to allowed roots: no symlink inside a source may lead out of them.

``datastore serve --allow ROOT`` stages trees on behalf of clients; a symlink inside ROOT that
points elsewhere would otherwise hand them any file the service can read. ``--confine ROOT``
(what the service passes) makes the plan skip, with an error, every source entry whose resolved
path is not beneath a root, and the copy engine check the descriptor it actually opened
(``/proc/self/fd``), so a link swapped in after planning is refused too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

__all__ = ["beneath", "leads_out", "open_regular", "opened_path"]


def beneath(path: str, roots: Sequence[str | os.PathLike]) -> bool:
    """Whether ``path``, every symlink resolved, is one of ``roots`` or lies under one."""
    real = os.path.realpath(path)
    for root in roots:
        r = os.path.realpath(root)
        if real == r or real.startswith(r.rstrip(os.sep) + os.sep):
            return True
    return False


def leads_out(path: str, roots: Sequence[str | os.PathLike]) -> bool:
    """Whether ``path`` lies under one of ``roots`` by its name, yet not once every symlink is
    resolved: a link under the roots leads it out (a stage's DEST swapped for one)."""
    named = os.path.abspath(path)
    return not beneath(path, roots) and any(
        named == r or named.startswith(r.rstrip(os.sep) + os.sep)
        for r in map(os.path.abspath, roots)
    )


def opened_path(fd: int) -> str:
    """The path the open descriptor ``fd`` refers to (Linux ``/proc/self/fd``). One of no
    file in a directory (a pipe, a socket: ``pipe:[INODE]``) is named under
    ``/proc/PID/fd``: taken as a relative path, it lay beneath the working directory, and a
    read through a link to ``/proc/self/fd/N`` passed as inside the roots."""
    link = os.readlink(f"/proc/self/fd/{fd}")
    return link if os.path.isabs(link) else os.path.join(f"/proc/{os.getpid()}/fd", link)


def open_regular(path: str | os.PathLike) -> int:
    """A read-only descriptor of the regular file at ``path``; ``OSError`` for anything else,
    unopened if it is a FIFO (a sample swapped for one after the check: the read's open
    waited for a writer, for ever)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(
            f"{os.fspath(path)}: not a regular file (a FIFO, socket, device or directory)"
        )
    os.set_blocking(fd, True)
    return fd

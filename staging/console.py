"""What every command's console shares: lines on stderr that stay whole when ranks share one
terminal, gRPC's info lines kept off it, and a reader of stdout that goes away (``| head``)
ending the command quietly."""

from __future__ import annotations

import os
import select
import sys

__all__ = ["grpc_errors_only", "reader_gone", "whole_lines"]


def whole_lines() -> None:
    """Write each line of this process's stderr in one ``write``. Under ``python -u`` or
    ``PYTHONUNBUFFERED`` (common in batch scripts) ``print`` writes a line's text and its
    newline apart, and the errors of ranks sharing a terminal run together on one line. A
    stderr replaced (a test capturing it) is left as it is."""
    if sys.stderr is sys.__stderr__ and hasattr(sys.stderr, "reconfigure"):
        sys.stderr.reconfigure(write_through=False, line_buffering=True)


def grpc_errors_only() -> None:
    """gRPC's C core writes info lines on stderr (``I1129 ... Handshake failed``, at every
    retry of a refused TLS handshake); the commands say why a call failed themselves. Only
    errors, unless the user set ``GRPC_VERBOSITY``; before gRPC is imported."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def reader_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (``| head`` has what it wanted): then
    stdout is pointed at ``/dev/null``, so that the interpreter's flush at exit does not fail
    again. ``False`` (a ``BrokenPipeError`` from elsewhere, a socket): a real failure."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no descriptor (replaced, closed)
        return False
    if gone:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    return gone

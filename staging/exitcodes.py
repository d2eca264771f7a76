"""The exit codes of every ``datastore`` command (one list, documented in the README)."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Agreed", "Exit"]


class Exit(IntEnum):
    """What a command's exit status means."""

    OK = 0  # done
    FAILED = 1  # the work failed (I/O error, a failed rank, a service that cannot listen)
    BAD_INPUT = 2  # usage, a missing or unsafe source, a refused argument
    NO_SPACE = 3  # not enough space in DEST (stage)
    MISMATCH = 4  # verify found missing or changed files (stage --verify)
    INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT
    READER_GONE = 141  # stdout's reader went away (`| head`), as a shell reports SIGPIPE


class Agreed(int):
    """An exit code every MPI rank returns at the same point of the command (after the
    collective that decided it, or with a world of its own), so the process may end MPI with
    ``MPI_Finalize`` (``staging.launcher.finalize_mpi``) rather than the ``MPI_Abort`` that
    ``python -m mpi4py`` makes of a non-zero exit: an abort line on stderr, and MPICH's
    shared-memory segment (about 2 MiB) left in ``/dev/shm`` for good."""

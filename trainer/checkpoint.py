"""Checkpoints written atomically: a temporary file in the same directory, then a rename; and
the directory held by one run at a time.

A crash while saving leaves the previous checkpoint intact; a reader never sees half a file.
Files a checkpoint needs besides its own (each data rank's optimizer state with ``lion_cub``)
are named by their step (:func:`own_optimizer_name`), so a save killed between them and the
checkpoint leaves the previous checkpoint's in place.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from collections.abc import Collection
from typing import IO, Any

import torch

__all__ = [
    "CHECKPOINT_NAME", "LOCK_NAME", "hold_directory", "load_checkpoint", "load_own_optimizer",
    "own_optimizer_name", "prune_own_optimizer", "save_checkpoint",
]  # fmt: skip

CHECKPOINT_NAME = "checkpoint.pt"
LOCK_NAME = "run.lock"
_held: dict[str, IO[str]] = {}  # directories this process holds, until it exits


def hold_directory(directory: str | os.PathLike) -> None:
    """Hold ``directory`` (made if missing; a ``flock`` on its ``run.lock``, which names the
    holder) until this process exits: a second run on it (a job resubmitted while the first
    still runs, a job array) would resume from the first's checkpoint mid-run and the two
    would overwrite each other's. A run of this process again (in-process, one after the
    other) keeps the hold. On a filesystem that takes no locks (Lustre mounted without
    ``flock``) nothing is held.

    Raises:
        ValueError: naming the directory and the run that holds it.
    """
    key = os.path.realpath(directory)
    if key in _held:
        return
    os.makedirs(directory, exist_ok=True)
    fh = open(os.path.join(directory, LOCK_NAME), "a+")  # noqa: SIM115 - held past this call
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise ValueError(
            f"config key 'checkpoint_dir': {os.fspath(directory)} is in use by another run "
            f"({holder}): two runs on one checkpoint_dir take over each other's checkpoints; "
            "wait for it to end or choose another checkpoint_dir"
        ) from None
    except OSError:  # (no locks here)
        fh.close()
        return
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    fh.flush()
    _held[key] = fh


def save_checkpoint(
    directory: str | os.PathLike, state: dict[str, Any], name: str = CHECKPOINT_NAME
) -> str:
    """Write ``state`` (``torch.save``-able) to ``directory/name`` atomically."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)
    return path


def load_checkpoint(
    directory: str | os.PathLike, name: str = CHECKPOINT_NAME, mmap: bool = False
) -> dict[str, Any] | None:
    """The state in ``directory/name``, or ``None`` if there is none (``mmap``: tensors are
    mapped, read only when used)."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def own_optimizer_name(data_rank: int, step: int) -> str:
    """The file of data rank ``data_rank``'s own optimizer state saved at ``step``."""
    return f"optimizer.d{data_rank}.step{step}.pt"


def own_optimizer_missing(directory: str | os.PathLike, data_rank: int, step: int) -> str:
    """Why a ``lion_cub`` run cannot resume: data rank ``data_rank``'s momenta saved at
    ``step`` are not in ``directory`` (said before a step, and by a rank as it loads)."""
    return (
        f"config key 'checkpoint_dir': {directory}/{own_optimizer_name(data_rank, step)}: "
        f"missing or not from step {step}; lion_cub resumes each data rank's own momenta, so "
        "the run must resume with the data ranks it was saved with"
    )


def load_own_optimizer(
    directory: str | os.PathLike, data_rank: int, step: int, mmap: bool = False
) -> dict[str, Any] | None:
    """Data rank ``data_rank``'s own optimizer state saved at ``step`` (or, written before the
    files were named by their step, ``optimizer.dR.pt`` if it is from ``step``); ``None`` if
    there is none."""
    for name in (own_optimizer_name(data_rank, step), f"optimizer.d{data_rank}.pt"):
        state = load_checkpoint(directory, name, mmap)
        if state is not None and state.get("step") == step:
            return state
    return None


def prune_own_optimizer(
    directory: str | os.PathLike, data_rank: int, keep: Collection[int]
) -> None:
    """Remove data rank ``data_rank``'s own optimizer files of the steps not in ``keep``."""
    named = re.compile(rf"optimizer\.d{data_rank}\.step(\d+)\.pt")
    for name in os.listdir(directory):
        found = named.fullmatch(name)
        if found and int(found[1]) not in keep:
            os.unlink(os.path.join(directory, name))

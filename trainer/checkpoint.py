"""Checkpoints written atomically: a temporary file in the same directory, then a rename.

A crash while saving leaves the previous checkpoint intact; a reader never sees half a file.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["CHECKPOINT_NAME", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "checkpoint.pt"


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

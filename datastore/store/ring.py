"""Batch buffers that are reused only when nobody holds them any more.

A loader fills batches into buffers it owns and hands out tensors that view them (no copy).
Reusing a buffer whose tensors a consumer still holds would change data under the consumer
(``[b["y"] for b in loader]`` would see later batches), so a buffer is reused only once the
storage of each of its tensors is referenced by the loader alone: PyTorch counts the
references to a storage, views included (``torch._C._storage_Use_Count``). A consumer that
drops its batches gets the same few buffers back (the zero-copy fast path); one that keeps them
gets fresh buffers, and the ones it keeps stay as they were.

A buffer that the loader's device stage copies from is also busy until that copy is done (its
CUDA event). Pinned batches handed to the consumer are never reused by the ring (``fresh``):
the consumer may copy them with ``.cuda(non_blocking=True)`` on any stream, a copy the ring
cannot see. Each such batch gets a new buffer from torch's caching host allocator
(``torch.empty(pin_memory=True)``, as torch's ``DataLoader`` pins), which notes every stream a
non-blocking copy reads a block on and gives the block out again only once an event recorded
there at its release has passed; the ring lets its free buffers go to it.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import torch

from datastore.maths.delivery import Delivered

__all__ = ["Buffer", "BufferRing", "can_pin", "staging_pinned", "torch_dtype", "use_count"]

_pin_note = threading.Lock()
_pin_noted = False


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors and views on it, numpy arrays over it)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def staging_pinned(pin_memory: bool, device: torch.device | None) -> bool:
    """Whether a loader's buffers are page-locked: when asked, and always when batches go to a
    CUDA device (its side-stream copies are asynchronous only from pinned memory)."""
    return bool(pin_memory) or (device is not None and device.type == "cuda")


def can_pin(pin: bool) -> bool:
    """Whether to page-lock buffers; without CUDA a one-time warning says it is ignored."""
    global _pin_noted
    if not pin or torch.cuda.is_available():
        return pin
    with _pin_note:
        if not _pin_noted:
            _pin_noted = True
            warnings.warn(
                "datastore: pin_memory needs CUDA; using pageable memory",
                UserWarning,
                stacklevel=3,
            )
    return False


class Buffer:
    """One batch's host memory: ``tensors`` (the loader's) and ``arrays`` (numpy views of them).

    A buffer is ``pending`` from when it is taken until its batch is handed out (or given
    back): it is busy then whatever the counts say.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.arrays = {n: t.numpy() for n, t in tensors.items()}
        self.event: Any = None  # a CUDA event recorded after the last copy out of this buffer
        self.pending = False
        self._baseline = {n: use_count(t) for n, t in tensors.items()}

    def views(self) -> dict[str, torch.Tensor]:
        """Tensors for a consumer: views of the buffer, which count as holding it."""
        out = {n: t.view(t.shape) for n, t in self.tensors.items()}
        self.pending = False
        return out

    def release_after(self, event: Any) -> None:
        """The batch went to the device: the buffer is free once ``event`` (the end of the
        copy; ``None``: it is done) has passed."""
        self.event = event
        self.pending = False

    def held(self) -> bool:
        """Whether the batch is still to be handed out, anyone but the loader references the
        buffer, or a device copy still reads it."""
        if self.pending:
            return True
        if self.event is not None:
            if not self.event.query():
                return True
            self.event = None
        return any(use_count(t) > self._baseline[n] for n, t in self.tensors.items())


class BufferRing:
    """Buffers for batches of ``batch_size`` samples of ``fields``, reused once free.

    Args:
        fields: what a rank receives.
        batch_size: samples per batch.
        keep: buffers kept for reuse; more are made when all are held, and dropped again once
            free. Default: ``4``.
        pin: page-locked memory (CUDA only; otherwise ignored with a warning once).
        fresh: never reuse a buffer: every ``take()`` makes a new one (uninitialised: every
            fill rewrites the whole box) and the free ones are let go, to torch's caching host
            allocator when pinned. For pinned batches handed to a consumer, whose own
            non-blocking copies only that allocator tracks. Default: ``False``.
    """

    def __init__(
        self,
        fields: list[Delivered],
        batch_size: int,
        keep: int = 4,
        pin: bool = False,
        fresh: bool = False,
    ) -> None:
        self.fields, self.batch_size, self.keep = fields, batch_size, max(1, keep)
        self.pin, self.fresh = can_pin(pin), fresh
        self._bufs: list[Buffer] = []  # every buffer made and kept; free once nobody holds it
        self._lock = threading.Lock()
        self.made = 0

    def _new(self) -> Buffer:
        make = torch.empty if self.fresh else torch.zeros  # a memset per batch is not free
        tensors = {
            f.name: make(
                (self.batch_size, *f.shape), dtype=torch_dtype(f.dtype), pin_memory=self.pin
            )
            for f in self.fields
        }
        self.made += 1
        return Buffer(tensors)

    def take(self) -> Buffer:
        """A buffer nobody holds (a new one when every buffer is held). Of the buffers found
        free, ``keep`` stay for reuse and the rest are let go; when ``fresh``, every buffer
        found free is let go (first, so the allocator may hand its memory out again) and a
        new one made."""
        with self._lock:
            if self.fresh:
                self._bufs = [b for b in self._bufs if b.held()]
                buf = self._new()
                self._bufs.append(buf)
            else:
                free = [b for b in self._bufs if not b.held()]
                for b in free[self.keep :]:
                    self._bufs.remove(b)
                buf = free[0] if free else self._new()
                if not free:
                    self._bufs.append(buf)
            buf.pending = True
            return buf

    def give_back(self, buf: Buffer) -> None:
        """``buf`` was never handed out (an iteration stopped before it): free at once."""
        buf.pending = False

    def __len__(self) -> int:
        return len(self._bufs)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the ring has now."""
        with self._lock:
            bufs = list(self._bufs)
        return sum(t.nbytes for b in bufs for t in b.tensors.values())

"""The device stage: batches copied to a GPU on a side stream, ahead of the training step.

The loader's producer thread copies each batch from its (pinned) host buffer to fresh device
tensors on a side CUDA stream and records an event. When the batch is handed out, the
consumer's current stream waits for that event (no host synchronisation), and every tensor is
marked as used by the consumer's stream (``record_stream``), so the caching allocator never
gives its memory to another batch while the training step still reads it; the batch's
``transform`` then runs on the consumer's thread and stream. The host buffer is reused only
once its copy is done (the event is kept on the buffer, see ``datastore.store.ring``).

Copies from pinned memory run at the link's speed without blocking the host; from pageable
memory they are synchronous and several times slower, so the loader pins its buffers, and the
service client registers its shared-memory segments with CUDA (:func:`register_host`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["DeviceStage", "parse_device", "register_host", "tensors_in", "unregister_host"]


def parse_device(device: Any) -> torch.device | None:
    """``device=`` as a ``torch.device`` (``None``: batches stay on the host).

    Raises ``ValueError`` for a CUDA device where CUDA is not available or out of range, and
    for ``"meta"`` (tensors without data).
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device: {exc}") from None
    if dev.type == "meta":
        raise ValueError(f"device={device!r} holds no data: every batch would be empty")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}, but CUDA is not available in this process")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}, but this process sees {torch.cuda.device_count()} GPU(s)"
            )
    return dev


def register_host(array_ptr: int, nbytes: int) -> bool:
    """Page-lock host memory we did not allocate (a shared-memory mapping) for CUDA copies
    (``cudaHostRegister``); ``False`` where CUDA refuses (the copies then run pageable)."""
    if nbytes <= 0 or not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(array_ptr, nbytes, 0)
    if int(rc) != 0:
        _clear_last_error()
    return int(rc) == 0


def _clear_last_error() -> None:
    """Reset CUDA's last error after a failure we handled: the next kernel launch check in this
    thread would otherwise report it. torch binds no ``cudaGetLastError``, so it is called in
    the runtime library torch already loaded (none loaded: nothing to do)."""
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        lib.cudaGetLastError()
        return


def unregister_host(array_ptr: int) -> None:
    """Undo :func:`register_host`."""
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(array_ptr)


Batch = dict[str, Any]


class DeviceStage:
    """Copies host batches to ``device`` on a side stream (CUDA), or plainly (other devices)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def upload(self, host: dict[str, torch.Tensor]) -> tuple[Batch, Any]:
        """``(device batch, event)``: the copies enqueued on the side stream; the event marks
        their end (``None`` off CUDA, where copies are synchronous)."""
        if self.stream is None:
            return {n: t.to(self.device) for n, t in host.items()}, None
        with torch.cuda.stream(self.stream):
            out = {n: t.to(self.device, non_blocking=True) for n, t in host.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def hand_out(self, batch: Batch, event: Any) -> Batch:
        """Make the caller's current stream wait for ``batch`` and own its tensors."""
        if event is None:
            return batch
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors_in(batch):
            if t.is_cuda:
                t.record_stream(current)
        return batch


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """Every tensor of a batch as a transform may return it: a tensor, or dicts, lists and
    tuples of them, nested."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        return [t for item in batch for t in tensors_in(item)]
    return []

"""Losses and validation metrics of both tasks, over a rank's block of each sample.

Tasks
    ``"vector"`` (CosmoFlow): the target is a vector per sample; every rank of a sample holds
    the whole prediction (the dense head is replicated). ``"voxel"`` (U-Net): the target is a
    volume; every rank holds its block of the prediction and of the target.

Loss (:func:`local_loss`)
    The mean squared error of the replica's batch is the sum of the ranks' ``local_loss`` over
    the spatial group: the vector task's is the plain MSE (the same on every rank of the
    sample, and its gradients reach the split layers through the replicated head), the voxel
    task's is the block's squared errors divided by the voxels of the *whole* samples. Either
    way the gradients the ``GradientReducer`` sums over the spatial group are those of the
    replica's MSE.

Metrics (:class:`Sums`)
    Per target channel, sums of squared errors and how many values they cover, accumulated on
    each rank and summed over the whole world when read; the vector task's sums are the same on
    every rank of a sample, which scales numerator and count alike. Baselines on the same
    samples: predicting the mean training target (its sums accumulated over the training
    batches of the first epoch, :class:`Sums` too) and, for the voxel task when input and
    target have the same channels, predicting the input itself (the identity).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.comm import all_reduce_sum

__all__ = ["Sums", "channel_sums", "local_loss"]


def local_loss(
    pred: torch.Tensor, target: torch.Tensor, task: str, whole_voxels: int
) -> torch.Tensor:
    """This rank's share of the replica's MSE (module docstring), in float32; ``task``: the
    model's (``trainer.model_table.Model.task``)."""
    err = (pred.float() - target.float()).square()
    if task == "vector":
        return err.mean()
    return err.sum() / (err.shape[0] * err.shape[1] * whole_voxels)


def channel_sums(
    values: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, int]:
    """Per channel (axis 1) sums of ``values`` over the valid samples and the other axes, in
    float64, and how many values each sum covers."""
    v = values.double()
    if valid is not None:
        v = v[valid.to(v.device)]
    per = math.prod(v.shape[2:])
    return v.sum(dim=[0, *range(2, v.dim())]), v.shape[0] * per


@dataclass
class Sums:
    """Sums per channel and the count of values they cover, on this rank (module docstring)."""

    channels: int
    device: torch.device
    total: torch.Tensor = field(init=False)
    count: int = 0

    def __post_init__(self) -> None:
        self.total = torch.zeros(self.channels, dtype=torch.float64, device=self.device)

    def add(self, values: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add ``values`` (``(B, C, ...)``) of the valid samples."""
        s, n = channel_sums(values, valid)
        self.total += s
        self.count += n

    def reduced(
        self, group: Any, timeout: datetime.timedelta, reduce: bool
    ) -> tuple[torch.Tensor, float]:
        """``(sums, count)`` summed over ``group`` (every rank of the world) when ``reduce``."""
        buf = torch.cat([self.total, self.total.new_tensor([float(self.count)])])
        if reduce:
            all_reduce_sum(buf, group, timeout)
        buf = buf.cpu()
        return buf[:-1], float(buf[-1])

    def mean(self, group: Any, timeout: datetime.timedelta, reduce: bool) -> torch.Tensor:
        """The per-channel mean over everything added on every rank (float64, CPU)."""
        total, count = self.reduced(group, timeout, reduce)
        return total / max(count, 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total.cpu(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = state["total"].to(self.device, torch.float64, copy=True)  # (not a map's)
        self.count = int(state["count"])

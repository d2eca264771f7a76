"""Batch normalization whose statistics span an explicit process group.

``DistBatchNorm3d(C, grid, stats_group=g)`` in training mode normalizes with the mean and
variance of the *concatenation* of the inputs of every rank of ``g``: pass
``grid.spatial_group`` for statistics over whole samples of one replica (plain data-parallel
BatchNorm: each replica normalizes its own batch), or a group of whole spatial groups, e.g. the
world (``torch.distributed.group.WORLD``), for statistics over the whole global batch. The
group must contain this rank's whole spatial group (checked): a part of a sample is never
normalized on its own.

Forward
    Each rank computes per channel its voxel count ``n``, sum ``s`` and sum of squares ``q``
    (accumulated in float64, ``q`` as the centred sum plus ``s**2 / n`` so that a large mean
    does not cancel the variance away), one all-reduce sums them over the group, and
    ``mean = S / N``, ``var = Q / N - mean**2`` (biased, for normalizing; unbiased for the
    running variance, exactly as ``torch.nn.BatchNorm3d``).

Backward
    With ``xhat = (x - mean) / sqrt(var + eps)`` and the upstream gradient ``dy``, one
    all-reduce gives the group sums ``Sdy`` and ``Sdyx`` of ``dy`` and ``dy * xhat``;
    ``dx = gamma / sqrt(var + eps) * (dy - Sdy / N - xhat * Sdyx / N)``. The returned gradients
    of ``gamma`` and ``beta`` are this rank's contributions (its local sums), like every other
    parameter of a spatially split layer: :func:`trainer.layers.sum_spatial_grads`, then the
    data-parallel reduction, make them the whole batch's.

Precision
    A bf16 or fp16 input (the output of a convolution under autocast) is normalized in float32,
    as ``torch.nn.BatchNorm3d`` under autocast: the mean is subtracted in float32, the inverse
    standard deviation kept for backward and the running statistics are float32 (float64
    group statistics, rounded once into the buffers), and the output and input gradient come
    back in the input's dtype: a float32 ``gamma`` does not promote them, so the next layer's
    halo carries bf16. float32 and float64 inputs compute in their own dtype.

Evaluation mode with running statistics is local (``F.batch_norm``), no communication.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.comm import all_reduce_sum
from trainer.grid import ProcessGrid

__all__ = ["DistBatchNorm3d", "SyncBatchNormFunction", "compute_dtype"]


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view(1, -1, *[1] * (ndim - 2))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the normalization computes in: float32 for a half input (bf16, fp16), as
    ``torch.nn.BatchNorm3d`` under autocast; the input's own for float32 and float64."""
    return torch.promote_types(dtype, torch.float32)


class SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm with group-wide statistics; see the module docstring.

    ``apply(x, weight, bias, eps, group, timeout)`` returns ``(y, mean, unbiased_var)``: ``y``
    in ``x``'s dtype, computed in :func:`compute_dtype` (float32 for a bf16 ``x``, whatever the
    dtype of ``weight``), and the statistics in float64, not differentiable. Backward keeps
    ``x`` and the per-channel mean and inverse standard deviation in the compute dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        group: Any,
        timeout: datetime.timedelta,
    ):
        nd, cdt = x.dim(), compute_dtype(x.dtype)
        dims = [0, *range(2, nd)]
        n = x.numel() // x.shape[1]
        s = x.sum(dims, dtype=torch.float64)
        centred = x - _per_channel((s / n).to(cdt), nd)  # promotes a half x to cdt
        q = centred.square().sum(dims, dtype=torch.float64) + s * s / n
        del centred
        if n <= 1 and dist.get_world_size(group) == 1:  # every rank holds >= 1 value
            raise ValueError(f"expected more than 1 value per channel in training, got {n}")
        count = torch.full((1,), float(n), dtype=torch.float64, device=x.device)
        stats = all_reduce_sum(torch.cat([s, q, count]), group, timeout)
        c = x.shape[1]
        total = stats[-1]  # a tensor: no host sync per layer on a GPU
        mean = stats[:c] / total
        var = (stats[c : 2 * c] / total - mean * mean).clamp_min(0)
        mean_c, invstd_c = mean.to(cdt), (var + eps).rsqrt().to(cdt)
        y = (x - _per_channel(mean_c, nd)).mul_(_per_channel(invstd_c, nd))
        if weight is not None:
            y.mul_(_per_channel(weight, nd))
        if bias is not None:
            y.add_(_per_channel(bias, nd))
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.total, ctx.group, ctx.timeout = total, group, timeout
        ctx.bias_dtype = None if bias is None else bias.dtype
        unbiased = var * total / (total - 1)
        ctx.mark_non_differentiable(mean, unbiased)
        return y.to(x.dtype), mean, unbiased

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _mean: Any, _var: Any):
        x, weight, mean, invstd = ctx.saved_tensors
        nd, cdt = dy.dim(), mean.dtype
        dims = [0, *range(2, nd)]
        xhat = (x - _per_channel(mean, nd)).mul_(_per_channel(invstd, nd))
        sum_dy = dy.sum(dims, dtype=cdt)
        sum_dy_xhat = (dy * xhat).sum(dims)  # dy promoted to cdt
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            sums = all_reduce_sum(torch.cat([sum_dy, sum_dy_xhat]), ctx.group, ctx.timeout)
            c = dy.shape[1]
            means = (sums.double() / ctx.total).to(cdt)  # total: a float64 tensor
            mean_dy, mean_dy_xhat = means[:c], means[c:]
            scale = invstd if weight is None else invstd * weight.to(cdt)
            g = dy - _per_channel(mean_dy, nd)  # cdt
            g.sub_(xhat.mul_(_per_channel(mean_dy_xhat, nd))).mul_(_per_channel(scale, nd))
            grad_x = g.to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


class DistBatchNorm3d(nn.Module):
    """``BatchNorm3d`` over a spatially split ``(N, C, D, H, W)`` with statistics over a group.

    Training mode (or no running statistics) equals ``torch.nn.BatchNorm3d`` on the inputs of
    all ranks of ``stats_group`` concatenated (whole samples), forward, backward and running
    statistics; a bf16 input computes in float32 and returns bf16 (module docstring).

    Args:
        num_features: channels ``C``.
        grid: this rank's process grid.
        stats_group: the process group the statistics span; must contain this rank's whole
            spatial group. Required: ``grid.spatial_group`` (per replica) or e.g.
            ``torch.distributed.group.WORLD`` (the global batch).
        eps: added to the variance. Default: ``1e-5``.
        momentum: of the running statistics; ``None`` for a cumulative average. Default: ``0.1``.
        affine: learn ``weight`` (gamma) and ``bias`` (beta). Default: ``True``.
        track_running_stats: keep running statistics (used in evaluation mode).
            Default: ``True``.
        device, dtype: of the parameters and buffers. Default: torch's defaults.

    Raises:
        ValueError: if ``stats_group`` lacks a rank of this rank's spatial group.
    """

    def __init__(
        self,
        num_features: int,
        grid: ProcessGrid,
        *,
        stats_group: Any,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        members = set(dist.get_process_group_ranks(stats_group))
        sample = {grid.spatial_peer(s) for s in range(grid.spatial_size)}
        if not sample <= members:
            raise ValueError(
                f"stats_group {sorted(members)} must contain the whole spatial group "
                f"{sorted(sample)} of rank {grid.rank}"
            )
        self.grid, self.stats_group = grid, stats_group
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        # The same defaults as torch (ones, zeros), so equal on every rank without a broadcast.
        bn = nn.BatchNorm3d(
            num_features,
            eps=eps,
            momentum=momentum,
            affine=affine,
            track_running_stats=track_running_stats,
            device=device,
            dtype=dtype,
        )
        self.register_parameter("weight", bn.weight)
        self.register_parameter("bias", bn.bias)
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block, normalized. In training a collective over ``stats_group``."""
        if x.dim() != 5:
            raise ValueError(f"DistBatchNorm3d expects (N, C, D, H, W), got {tuple(x.shape)}")
        if not self.training and self.running_mean is not None:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        y, mean, var = SyncBatchNormFunction.apply(
            x, self.weight, self.bias, self.eps, self.stats_group, self.grid.timeout
        )
        if self.training and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum
                if m is None:
                    m = 1.0 / float(self.num_batches_tracked)
                # mean, var: float64, rounded once into the buffers' dtype
                self.running_mean.mul_(1 - m).add_(mean, alpha=m)
                self.running_var.mul_(1 - m).add_(var, alpha=m)
        return y

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, track_running_stats={self.track_running_stats}"
        )

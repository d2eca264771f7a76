"""Learning-rate schedules and the LARS and Lion optimizers.

Schedule (:func:`lr_at`, pure)
    Linear scaling by the global batch (Goyal et al. 2017), ``peak = base_lr * global_batch /
    base_batch``; a linear warmup over steps ``0 .. warmup_steps - 1``, ``peak * (step + 1) /
    warmup_steps``; then ``"constant"`` (``peak``), ``"linear"`` or ``"cosine"`` decay from
    ``peak`` to ``final_lr`` at ``total_steps``, with ``t = (step - warmup) / (total - warmup)``::

        linear: final + (peak - final) * (1 - t)
        cosine: final + (peak - final) * (1 + cos(pi * t)) / 2

    and ``final_lr`` from ``total_steps`` on. Use with ``torch.optim.SGD(momentum=...)``, LARS or
    Lion through :func:`set_lr`.

LARS (You et al. 2017, Algorithm 1), per parameter ``w`` with gradient ``g``::

    trust = eta * ||w|| / (||g|| + wd * ||w||)   (1 if ||w|| or ||g|| is 0)
    v = momentum * v + lr * trust * (g + wd * w)
    w = w - v

    Parameters of a group with ``lars_exclude=True`` (biases and normalization parameters, see
    :func:`split_decay_groups`) take plain momentum SGD without weight decay: ``trust = 1``,
    ``wd = 0``. The norms are of the whole parameter: one split over ranks (a
    :class:`~trainer.dense.DistFlattenLinear`'s columns) takes them from ``norms``
    (:func:`trainer.dense.whole_norms`).

Lion (Chen et al. 2023), with decoupled weight decay::

    update = sign(beta1 * m + (1 - beta1) * g)
    w = w * (1 - lr * wd) - lr * update
    m = beta2 * m + (1 - beta2) * g
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "LARS",
    "LRSchedule",
    "Lion",
    "Norms",
    "lion_apply",
    "lion_direction",
    "local_norms",
    "lr_at",
    "set_lr",
    "split_decay_groups",
]

DECAYS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate schedule (see the module docstring); evaluate it with :func:`lr_at`.

    Args:
        base_lr: learning rate at ``base_batch``.
        global_batch: samples per step over all data ranks. Default: ``1``.
        base_batch: the batch ``base_lr`` was tuned for. Default: ``1``.
        warmup_steps: steps of linear warmup. Default: ``0``.
        total_steps: where the decay ends (needed by ``"linear"`` and ``"cosine"``). Default: ``0``.
        decay: ``"constant"``, ``"linear"`` or ``"cosine"``. Default: ``"constant"``.
        final_lr: learning rate at and after ``total_steps``. Default: ``0.0``.
    """

    base_lr: float
    global_batch: int = 1
    base_batch: int = 1
    warmup_steps: int = 0
    total_steps: int = 0
    decay: str = "constant"
    final_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.base_lr < 0 or self.final_lr < 0:
            raise ValueError("learning rates must be >= 0")
        if self.global_batch < 1 or self.base_batch < 1:
            raise ValueError("batch sizes must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if self.decay != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"{self.decay} decay needs total_steps > warmup_steps, got "
                f"{self.total_steps} <= {self.warmup_steps}"
            )

    @property
    def peak_lr(self) -> float:
        """``base_lr * global_batch / base_batch``."""
        return self.base_lr * self.global_batch / self.base_batch


def lr_at(step: int, schedule: LRSchedule) -> float:
    """The learning rate of (0-based) ``step`` under ``schedule``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    s, peak = schedule, schedule.peak_lr
    if step < s.warmup_steps:
        return peak * (step + 1) / s.warmup_steps
    if s.decay == "constant":
        return peak
    if step >= s.total_steps:
        return s.final_lr
    t = (step - s.warmup_steps) / (s.total_steps - s.warmup_steps)
    if s.decay == "linear":
        return s.final_lr + (peak - s.final_lr) * (1 - t)
    return s.final_lr + (peak - s.final_lr) * (1 + math.cos(math.pi * t)) / 2


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def split_decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: weights (``ndim > 1``) with ``weight_decay``; biases and
    normalization parameters (``ndim <= 1``) without, and excluded from LARS adaptation
    (``lars_exclude=True``)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
        {
            "params": [p for p in params if p.ndim <= 1],
            "weight_decay": 0.0,
            "lars_exclude": True,
        },
    ]


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    """What ``closure`` returns, run with gradients enabled (``None`` without one): the loss
    ``Optimizer.step(closure)`` returns."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


Norms = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(||w||, ||g||)`` of a parameter ``w`` and its gradient ``g`` (LARS's trust ratio)."""


def local_norms(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-norms of ``w`` and ``g`` themselves."""
    return torch.linalg.vector_norm(w), torch.linalg.vector_norm(g)


def _state_buffer(state: dict[str, Any], name: str, p: torch.Tensor) -> torch.Tensor:
    """``state[name]``, created as zeros like ``p`` on first use (a momentum buffer)."""
    if name not in state:
        state[name] = torch.zeros_like(p)
    return state[name]


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling with momentum (formulas in the module docstring).

    Args:
        params: parameters or groups (a group may set ``lars_exclude=True``).
        lr: global learning rate.
        momentum: Default: ``0.9``.
        weight_decay: Default: ``0.0``.
        eta: trust coefficient. Default: ``0.001``.
        norms: ``(||w||, ||g||)`` of a parameter and its gradient. Default: ``None``, of the
            tensors themselves; a parameter split over ranks needs its whole norms
            (:func:`trainer.dense.whole_norms`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        *,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        norms: Norms | None = None,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0 or eta <= 0:
            raise ValueError("LARS needs lr, momentum, weight_decay >= 0 and eta > 0")
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, lars_exclude=False
        )
        super().__init__(params, defaults)
        self.norms = norms or local_norms

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        for group in self.param_groups:
            exclude = group["lars_exclude"]
            wd = 0.0 if exclude else group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                scale = group["lr"]
                if not exclude:
                    w_norm, g_norm = self.norms(p, g)
                    trust = group["eta"] * w_norm / (g_norm + wd * w_norm)
                    ok = (w_norm > 0) & (g_norm > 0)
                    scale = scale * torch.where(ok, trust, torch.ones_like(trust))
                d = g.add(p, alpha=wd) if wd else g
                v = _state_buffer(self.state[p], "momentum_buffer", p)
                v.mul_(group["momentum"]).add_(d * scale)
                p.sub_(v)
        return loss


def lion_direction(m: torch.Tensor, g: torch.Tensor, beta1: float) -> torch.Tensor:
    """``sign(beta1 * m + (1 - beta1) * g)``: Lion's update direction (0 where that is 0)."""
    return torch.sign(m * beta1 + g * (1 - beta1))


@torch.no_grad()
def lion_apply(
    p: torch.Tensor,
    m: torch.Tensor,
    g: torch.Tensor,
    direction: torch.Tensor,
    *,
    lr: float,
    beta2: float,
    weight_decay: float,
) -> None:
    """In place: ``p = p * (1 - lr * wd) - lr * direction``; ``m = beta2 * m + (1 - beta2) * g``."""
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    p.add_(direction.to(p.dtype), alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)


def _check_lion(lr: float, betas: tuple[float, float], weight_decay: float) -> None:
    if lr < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"Lion needs lr, weight_decay >= 0 and betas in [0, 1), got {betas}")


class Lion(torch.optim.Optimizer):
    """EvoLved Sign Momentum (formulas in the module docstring); state ``exp_avg`` is ``m``.

    Args:
        params: parameters or groups.
        lr: learning rate (typically 3-10x smaller than AdamW's).
        betas: ``(beta1, beta2)``. Default: ``(0.9, 0.99)``.
        weight_decay: decoupled weight decay. Default: ``0.0``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        *,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        _check_lion(lr, betas, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = _state_buffer(self.state[p], "exp_avg", p)
                u = lion_direction(m, p.grad, beta1)
                lion_apply(
                    p, m, p.grad, u, lr=group["lr"], beta2=beta2, weight_decay=group["weight_decay"]
                )
        return loss

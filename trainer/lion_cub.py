"""Lion Cub-style data-parallel Lion: exchange update signs, not gradients.

Lion's update is a sign, so the data ranks can agree on it by a vote instead of averaging
full-precision gradients (Lion Cub, Ishikawa et al. 2024; the majority vote of signSGD,
Bernstein et al. 2018). Every data rank ``r`` keeps its own momentum ``m_r`` and computes,
from its local gradient ``g_r`` (the whole-sample gradient: sum it over the spatial group first,
e.g. ``GradientReducer(..., reduce_data=False)``)::

    vote_r = sign(beta1 * m_r + (1 - beta1) * g_r)          in {-1, 0, +1}
    update = sign(sum_r vote_r)                              majority; a tie gives 0
    w = w * (1 - lr * wd) - lr * update                     the same on every rank
    m_r = beta2 * m_r + (1 - beta2) * g_r
    every K steps: m_r = mean_r m_r                          full-precision all_reduce

Two exchanges give the same sum:

``"int8"``
    ``all_reduce(SUM)`` of the votes as ``int8`` (sums lie in ``-P..P``, so ``P <= 127`` data
    ranks): ``n`` bytes per step for ``n`` parameters.
``"packed"``
    One bit per vote (1 for ``+1``) packed into ``uint8``, after one flag byte that says whether
    this rank has a zero vote; ``all_gather`` of the ``1 + ceil(n / 8)`` bytes, then, only when
    some rank raised its flag, an ``all_gather`` of a second plane (1 for a non-zero vote,
    ``ceil(n / 8)`` bytes). Every rank unpacks and sums the votes itself.

Accounting (:class:`CommStats`): ``bytes_sent`` adds up the input buffer this rank hands to
each collective (votes, and the momentum sync in the momentum's dtype); ``bytes_fp32`` what an
fp32 gradient ``all_reduce`` of the same parameters would have handed over (``4 * n`` per step).
Nothing is sent, nor counted, with one data rank. Wire traffic differs by algorithm: a ring
``all_reduce`` moves about twice its buffer, and an ``all_gather`` receives ``P`` buffers, so
packed votes beat an int8 ``all_reduce`` only for small ``P``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.comm import all_gather, all_reduce_sum
from trainer.grid import ProcessGrid
from trainer.optim import (
    _check_lion,
    _closure_loss,
    _state_buffer,
    lion_apply,
    lion_direction,
)

__all__ = ["MODES", "CommStats", "LionCub", "majority", "pack_bits", "unpack_bits"]

MODES = ("int8", "packed")

_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D bool tensor into ``ceil(n / 8)`` bytes, first element in the high bit."""
    n = bits.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits
    return (padded.view(-1, 8) * _WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits of ``packed`` as a bool tensor."""
    return (packed.unsqueeze(1) & _WEIGHTS.to(packed.device)).ne(0).view(-1)[:n]


def majority(vote_sum: torch.Tensor) -> torch.Tensor:
    """``sign`` of the summed votes as ``int8``: the majority, 0 on a tie."""
    return torch.sign(vote_sum).to(torch.int8)


@dataclass
class CommStats:
    """Bytes of the data-parallel exchange so far (see the module docstring)."""

    steps: int = 0
    bytes_sent: int = 0
    bytes_fp32: int = 0

    @property
    def bytes_saved(self) -> int:
        """``bytes_fp32 - bytes_sent``."""
        return self.bytes_fp32 - self.bytes_sent

    @property
    def ratio(self) -> float:
        """``bytes_sent / bytes_fp32`` (1.0 before anything was exchanged)."""
        return self.bytes_sent / self.bytes_fp32 if self.bytes_fp32 else 1.0


class LionCub(torch.optim.Optimizer):
    """Lion whose update is the majority vote of the data ranks' signs (module docstring).

    Collective over ``grid.data_group`` in :meth:`step`: every parameter needs a gradient on
    every rank. With one data rank it is exactly :class:`~trainer.optim.Lion`.

    Args:
        params: parameters or groups; all votes travel in one buffer per step.
        grid: this rank's process grid (data group and timeout).
        lr: learning rate.
        betas: ``(beta1, beta2)``. Default: ``(0.9, 0.99)``.
        weight_decay: decoupled weight decay. Default: ``0.0``.
        mode: ``"int8"`` or ``"packed"``. Default: ``"int8"``.
        momentum_sync_every: average the momenta over the data group every this many steps;
            ``0`` never. Default: ``0``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        grid: ProcessGrid,
        lr: float,
        *,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        mode: str = "int8",
        momentum_sync_every: int = 0,
    ) -> None:
        _check_lion(lr, betas, weight_decay)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "int8" and grid.data_size > 127:
            raise ValueError(f"int8 vote sums overflow beyond 127 data ranks ({grid.data_size})")
        if momentum_sync_every < 0:
            raise ValueError(f"momentum_sync_every must be >= 0, got {momentum_sync_every}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.grid = grid
        self.mode = mode
        self.momentum_sync_every = momentum_sync_every
        self.comm = CommStats()

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = all_gather(t, self.grid.data_group, self.grid.timeout)
        self.comm.bytes_sent += t.numel() * t.element_size()
        return out

    def _vote_sum(self, votes: torch.Tensor) -> torch.Tensor:
        """Sum of every data rank's ``int8`` votes."""
        if self.mode == "int8":
            total = all_reduce_sum(votes.clone(), self.grid.data_group, self.grid.timeout)
            self.comm.bytes_sent += total.numel()
            return total
        n = votes.numel()
        flag = votes.eq(0).any().to(torch.uint8).view(1)
        got = self._all_gather(torch.cat([flag, pack_bits(votes > 0)]))
        signs = [2 * unpack_bits(t[1:], n).to(torch.int8) - 1 for t in got]
        if any(int(t[0]) for t in got):
            planes = self._all_gather(pack_bits(votes != 0))
            signs = [s * unpack_bits(z, n) for s, z in zip(signs, planes, strict=True)]
        return torch.stack(signs).sum(0, dtype=torch.int32)

    def _sync_momentum(self, moments: list[torch.Tensor]) -> None:
        flat = torch.cat([m.reshape(-1) for m in moments])
        all_reduce_sum(flat, self.grid.data_group, self.grid.timeout)
        self.comm.bytes_sent += flat.numel() * flat.element_size()
        flat.div_(self.grid.data_size)
        offset = 0
        for m in moments:
            m.copy_(flat[offset : offset + m.numel()].view_as(m))
            offset += m.numel()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = _closure_loss(closure)
        items = []  # (param, momentum, group)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    raise RuntimeError("LionCub needs a gradient for every parameter")
                items.append((p, _state_buffer(self.state[p], "exp_avg", p), group))
        votes = torch.cat(
            [
                lion_direction(m, p.grad, g["betas"][0]).to(torch.int8).reshape(-1)
                for p, m, g in items
            ]
        )
        shared = self.grid.data_size > 1
        update = majority(self._vote_sum(votes)) if shared else votes
        offset = 0
        for p, m, g in items:
            u = update[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            lion_apply(
                p, m, p.grad, u, lr=g["lr"], beta2=g["betas"][1], weight_decay=g["weight_decay"]
            )
        self.comm.steps += 1
        if shared:
            self.comm.bytes_fp32 += 4 * votes.numel()
            k = self.momentum_sync_every
            if k and self.comm.steps % k == 0:
                self._sync_momentum([m for _, m, _ in items])
        return loss

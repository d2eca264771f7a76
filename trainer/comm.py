"""Group collectives that wait with a timeout, so a failing rank cannot hang the others."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather", "all_reduce_sum"]


def all_reduce_sum(t: torch.Tensor, group: Any, timeout: datetime.timedelta) -> torch.Tensor:
    """Sum ``t`` over ``group`` in place and return it; waits at most ``timeout``."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True).wait(timeout)
    return t


def all_gather(t: torch.Tensor, group: Any, timeout: datetime.timedelta) -> list[torch.Tensor]:
    """``t`` of every rank of ``group``, by group rank (equal shapes); waits at most ``timeout``."""
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t, group=group, async_op=True).wait(timeout)
    return out

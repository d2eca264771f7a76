"""Bucketed weight-gradient reduction over a ProcessGrid, overlapped with backward.

In a data x spatial parallel job the gradient a rank computes for a weight is partial twice:
over the blocks of its sample (the spatial group) and over the samples of the global batch (the
data group). The gradient of the whole batch, averaged over replicas as in plain data
parallelism, is::

    grad = (1 / D) * sum_{data ranks d} sum_{spatial ranks s} grad_{d, s}

Parameters that are *not* spatially partial (replicated compute whose gradient every block of a
sample already holds in full) get the data average only.

:class:`GradientReducer` packs the gradients into flat buckets in reverse registration order
(the order backward produces them, as ``DistributedDataParallel`` does), and a post-accumulate
gradient hook on every parameter starts a bucket's ``all_reduce`` (``async_op=True``) as soon
as all its gradients are ready. Buckets start strictly in bucket order on every rank, so every
group sees the same sequence of collectives. A spatially partial bucket is summed over the
spatial group first; its data-group sum starts when the next bucket starts (after waiting for
the spatial sum, which ran while backward computed that next bucket) or in
:meth:`~GradientReducer.finish`. ``finish()`` waits for everything with the grid's timeout,
divides by ``D`` and writes the results into ``.grad``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer.comm import start_all_reduce
from trainer.grid import ProcessGrid

__all__ = ["DEFAULT_BUCKET_BYTES", "GradientReducer", "plan_buckets"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Bucket capacity, as ``DistributedDataParallel``'s default ``bucket_cap_mb=25``."""


def plan_buckets(sizes: list[tuple[int, Any]], bucket_bytes: int) -> list[list[int]]:
    """Split items into consecutive buckets; returns the item indices of every bucket.

    Args:
        sizes: ``(bytes, key)`` per item, in bucket order; items with different keys (dtype,
            device, reduction) never share a bucket.
        bucket_bytes: capacity: a bucket closes before the item that would overflow it, so an
            item larger than the capacity gets a bucket of its own.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[int]] = []
    used, last_key = 0, None
    for i, (nbytes, key) in enumerate(sizes):
        if not buckets or key != last_key or used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += nbytes
        last_key = key
    return buckets


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    partial: bool  # summed over the spatial group before the data group
    pending: int = 0  # gradients not ready yet in this round
    ready: set[int] = field(default_factory=set)  # id() of the params already copied in
    stages: list[Any] = field(default_factory=list)  # groups still to reduce over, in order
    work: Any = None  # the collective in flight


class GradientReducer:
    """Sum weight gradients over the spatial group and average them over the data group.

    Call :meth:`finish` after every ``backward()``; afterwards every rank holds the reduced
    gradient in ``.grad`` of each parameter. Collective over the whole grid: every rank must run
    the same backward (the same parameters get gradients, in the same order). A parameter with
    no gradient by ``finish()`` contributes zeros (and then gets the reduced ``.grad``).

    Args:
        module: the model; its parameters with ``requires_grad`` are reduced.
        grid: this rank's process grid (groups and timeout).
        bucket_bytes: bucket capacity in bytes. Default: ``DEFAULT_BUCKET_BYTES`` (25 MiB).
        spatially_partial: the parameters whose gradient is a per-block partial sum. Default:
            ``None``, all of them (in a spatially split model every weight sees only its block).
        reduce_data: average over the data group too; ``False`` sums over the spatial group
            only (for a data-parallel exchange of its own, e.g. ``LionCub``). Default: ``True``.
        overlap: start each bucket's reduction during backward, as soon as its gradients are
            ready; ``False`` starts them all in :meth:`finish` (for measuring what the overlap
            hides). Default: ``True``.
    """

    def __init__(
        self,
        module: nn.Module,
        grid: ProcessGrid,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        spatially_partial: Iterable[nn.Parameter] | None = None,
        reduce_data: bool = True,
        overlap: bool = True,
    ) -> None:
        self.grid = grid
        self.reduce_data = reduce_data
        self.overlap = overlap
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        partial = (
            {id(p) for p in params}
            if spatially_partial is None
            else {id(p) for p in spatially_partial}
        )
        keys = [(p.dtype, p.device, id(p) in partial) for p in params]
        plan = plan_buckets(
            [(p.numel() * p.element_size(), k) for p, k in zip(params, keys, strict=True)],
            bucket_bytes,
        )
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}
        for indices in plan:
            members = [params[i] for i in indices]
            offsets, n = [], 0
            for p in members:
                offsets.append(n)
                n += p.numel()
            first = members[0]
            b = _Bucket(
                members,
                offsets,
                torch.zeros(n, dtype=first.dtype, device=first.device),
                keys[indices[0]][2],
            )
            self.buckets.append(b)
            for j, p in enumerate(members):
                self._where[id(p)] = (b, j)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._reset()

    @property
    def launched(self) -> int:
        """Buckets whose reduction has started in this round (all of them after backward)."""
        return self._next

    def _reset(self) -> None:
        self._next = 0  # the next bucket to start
        self._advance = 0  # the first bucket that may have stages left
        for b in self.buckets:
            b.pending, b.ready, b.work = len(b.params), set(), None
            b.stages = []
            if b.partial and self.grid.spatial_size > 1:
                b.stages.append(self.grid.spatial_group)
            if self.reduce_data and self.grid.data_size > 1:
                b.stages.append(self.grid.data_group)

    def _on_grad(self, p: torch.Tensor) -> None:
        b, j = self._where[id(p)]
        if id(p) in b.ready:
            raise RuntimeError("a second backward before GradientReducer.finish()")
        b.flat[b.offsets[j] : b.offsets[j] + p.numel()].view_as(p).copy_(p.grad)
        b.ready.add(id(p))
        b.pending -= 1
        if not self.overlap:
            return
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self._next)

    def _start(self, index: int) -> None:
        """Start bucket ``index``'s first stage after moving every earlier bucket on."""
        self._move_on(index)
        self._next_stage(self.buckets[index])
        self._next = index + 1

    def _move_on(self, upto: int) -> None:
        # Earlier buckets' second stages start here, in bucket order, so the sequence of
        # collectives on each group is the same on every rank whatever the timing.
        for b in self.buckets[self._advance : upto]:
            while b.work is not None and b.stages:
                self._next_stage(b)
        self._advance = upto

    def _next_stage(self, b: _Bucket) -> None:
        if b.work is not None:
            b.work.wait()
            b.work = None
        if b.stages:
            b.work = start_all_reduce(b.flat, b.stages.pop(0), self.grid.timeout)

    def finish(self) -> None:
        """Wait for every reduction (with the grid's timeout) and write the results to ``.grad``.

        Buckets that backward did not complete start here, the missing gradients as zeros.
        """
        for i in range(self._next, len(self.buckets)):
            b = self.buckets[i]
            for j, p in enumerate(b.params):
                if id(p) not in b.ready:
                    b.flat[b.offsets[j] : b.offsets[j] + p.numel()].zero_()
            self._start(i)
        self._move_on(len(self.buckets))
        scale = self.grid.data_size if self.reduce_data and self.grid.data_size > 1 else 1
        for b in self.buckets:
            self._next_stage(b)  # waits for the last stage
            if scale > 1:
                b.flat.div_(scale)
            for p, o in zip(b.params, b.offsets, strict=True):
                reduced = b.flat[o : o + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = reduced.clone()
                else:
                    p.grad.copy_(reduced)
        self._reset()

    def remove(self) -> None:
        """Remove the gradient hooks (the reducer is unusable afterwards)."""
        for h in self._handles:
            h.remove()
        self._handles = []

"""Halo exchange over the spatial group, as an autograd Function with its exact adjoint.

A rank holds the owned block ``x`` of shape ``(N, C, *owned)`` of a volume split by
``ProcessGrid.parts`` (the last ``len(parts)`` axes are spatial, in grid-axis order).
:func:`halo_exchange` returns ``(N, C, *(owned + 2 * halo))``: the block surrounded by a halo of
``halo[axis]`` voxels per side, filled with the neighbours' voxels, corners included, and zero
where the halo sticks out of the global volume. It equals
``datastore.maths.partition.extract_block`` of the whole volume with ``Grid(shape, parts, halo,
boundary="zero")``.

Forward, ``H = E_{d-1} ... E_1 E_0 P``
    ``P`` zero-pads every axis by its halo. ``E_k`` exchanges along axis ``k`` only: each rank
    sends the ``halo[k]`` owned voxels next to a neighbour (its *edge* slab) and writes what it
    receives into its halo slab on that side. The slabs span the *full padded extent* of every
    other axis, so a halo filled along an earlier axis travels on: a corner reaches its diagonal
    neighbour in two hops (three for a 3-D corner), with ``2 * d`` messages instead of
    ``3**d - 1``. Axes with one block, or a halo of 0, exchange nothing.

Backward, ``H^T = P^T E_0^T E_1^T ... E_{d-1}^T``
    ``E_k`` overwrites a halo slab (zero before) with the neighbour's edge, so ``E_k^T`` sends
    the gradient of each halo slab back to the neighbour that owns those voxels, *adds* it into
    that neighbour's edge slab, and zeroes the halo slab it sent. Axes go in reverse order and
    ``P^T`` drops the halo. Halo sides at the global boundary receive nothing in forward and
    keep their gradient until ``P^T`` drops it. Exactly the adjoint: ``<H x, y> == <x, H^T y>``
    summed over the spatial group (tests/test_trainer_halo.py).

    Two things that look essential are not, and tests cannot tell them apart: the axis order
    (a corner arrives by either path, so ``H`` is the same for any order of the ``E_k``) and
    the zeroing (a value in an axis-``k`` halo only ever moves into other ranks' axis-``k``
    halos, which ``P^T`` drops). Both are kept so that each step is literally ``E_k^T``. What
    matters, and is tested, is the full extent of the slabs (corners) and the adding.

Messages go between *group* ranks of the spatial group on contiguous buffers of the tensor's
device and dtype, through :mod:`trainer.comm`: directly over NCCL (device tensors) or gloo (CPU
tensors), staged through page-locked host memory for CUDA tensors over gloo. Tags name the axis
and direction, so the two messages between a pair of ranks cannot be confused.

Memory format: every tensor keeps the input's layout, ``channels_last_3d`` (channels
innermost, what cuDNN runs fastest under bf16) or contiguous, forward and backward: the padded
block; the message buffers, which hold a slab with its axes in memory order (``(N, D, H, W,
C)`` for ``channels_last_3d``), so that sending and landing copy without permuting; the output
and the input gradient (:func:`layout_of` the input: an incoming gradient of another layout is
converted in the copy the adjoint makes anyway). A message is raw bytes in the sender's
layout, so every rank of the spatial group must pass inputs of one memory format (the trainer
does: one model and one batch format on every rank).

Split forward, for overlap (:func:`start_halo_exchange`, :func:`finish_halo_exchange`)
    ``start`` returns ``P x`` (the zero-padded block, halos still zero) and posts ``E_j`` of the
    first exchanging axis ``j`` without waiting; ``finish`` waits for it, then runs the other
    axes as above and returns ``H x``. Between the two, the caller may compute anything that
    reads no halo received from a neighbour (``DistConv3d``'s interior outputs). As autograd
    Functions, ``start`` is ``P`` (backward ``P^T``, the crop) and ``finish`` is
    ``E_{d-1} ... E_j`` on its input (backward ``E_j^T ... E_{d-1}^T``, blocking as always; the
    backward is not overlapped). ``finish(start(x))`` is ``halo_exchange(x)``, forward and
    backward.

Timing: :data:`wait_clock` adds up the host seconds spent blocked in the exchanges' waits
(``time.perf_counter`` around ``Pending.wait``), forward and backward apart, so a benchmark
can report the exposed share of the halo exchange (``wait_clock.reset()`` before a step).
On NCCL a wait only orders the CUDA stream and returns at once; there the host clock sees
nothing and device time (CUDA events) is the measure.

Limits: a halo is taken from the direct neighbour only, so along a split axis a block must own
at least ``halo[axis]`` voxels (``Grid`` enforces ``halo <= n // parts``); no periodic wrap.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from trainer.comm import Pending, start_exchange
from trainer.grid import ProcessGrid

__all__ = [
    "HaloExchange",
    "StartedHalo",
    "WaitClock",
    "exchange_axes",
    "exchange_slices",
    "finish_halo_exchange",
    "halo_exchange",
    "layout_of",
    "padded_shape",
    "start_halo_exchange",
    "wait_clock",
]

Slabs = dict[str, tuple[slice, ...]]


@dataclass
class WaitClock:
    """Host seconds blocked in halo-exchange waits (``time.perf_counter`` around each wait).

    Attributes:
        forward_s, backward_s: seconds blocked in forward (``H``) and backward (``H^T``).
        forward_waits, backward_waits: how many waits (one per exchanging axis and pass).
    """

    forward_s: float = 0.0
    backward_s: float = 0.0
    forward_waits: int = 0
    backward_waits: int = 0

    def reset(self) -> None:
        """Zero every counter."""
        self.forward_s = self.backward_s = 0.0
        self.forward_waits = self.backward_waits = 0

    def wait(self, pending: Pending, backward: bool = False) -> None:
        """``pending.wait()``, timed into the forward or backward counters."""
        start = time.perf_counter()
        pending.wait()
        seconds = time.perf_counter() - start
        if backward:
            self.backward_s += seconds
            self.backward_waits += 1
        else:
            self.forward_s += seconds
            self.forward_waits += 1


wait_clock = WaitClock()
"""The process-wide clock of every halo exchange's waits (see the module docstring)."""


def layout_of(t: torch.Tensor) -> torch.memory_format:
    """``channels_last_3d`` for a 5-D tensor laid out channels innermost, else contiguous."""
    channels_last = t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)
    if channels_last and not t.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def _wire(t: torch.Tensor, layout: torch.memory_format) -> torch.Tensor:
    """``t`` with its axes in the memory order of ``layout`` (a view): ``(N, D, H, W, C)`` for
    ``channels_last_3d``. A message travels as such a view made contiguous (what gloo and NCCL
    take), which a slab of that layout is copied into without permuting."""
    return t.permute(0, 2, 3, 4, 1) if layout == torch.channels_last_3d else t


def _unwire(buf: torch.Tensor, layout: torch.memory_format) -> torch.Tensor:
    """The inverse of :func:`_wire`: ``(N, C, D, H, W)`` again, in ``layout``."""
    return buf.permute(0, 4, 1, 2, 3) if layout == torch.channels_last_3d else buf


def padded_shape(owned: Sequence[int], halo: Sequence[int]) -> tuple[int, ...]:
    """Spatial shape of a block with its halo: ``owned + 2 * halo`` per axis."""
    if len(owned) != len(halo):
        raise ValueError(f"length mismatch: owned {tuple(owned)} and halo {tuple(halo)}")
    return tuple(n + 2 * h for n, h in zip(owned, halo, strict=True))


def exchange_slices(owned: Sequence[int], halo: Sequence[int], axis: int) -> Slabs:
    """The four slabs of an exchange along ``axis``, in padded-block coordinates.

    Args:
        owned: spatial shape of the owned block.
        halo: halo width per axis.
        axis: the exchange axis.

    Returns:
        Spatial slices (one per axis; every axis but ``axis`` is its full padded extent) of
        ``"halo_lo"``/``"halo_hi"`` (the halo on the low/high side, ``[0, h)`` and
        ``[h + n, n + 2h)``) and ``"edge_lo"``/``"edge_hi"`` (the owned voxels the low/high
        neighbour needs, ``[h, 2h)`` and ``[n, n + h)``).

    Raises:
        ValueError: if the block owns fewer than ``halo[axis]`` voxels along ``axis``.
    """
    n, h = owned[axis], halo[axis]
    if h < 0:
        raise ValueError(f"halo[{axis}]={h}: a halo width must be >= 0")
    if n < h:
        raise ValueError(
            f"a block of {n} voxels along axis {axis} cannot fill a halo of {h} "
            "(halos come from the direct neighbour only)"
        )
    full = [slice(None)] * len(owned)

    def along(s: slice) -> tuple[slice, ...]:
        out = list(full)
        out[axis] = s
        return tuple(out)

    return {
        "halo_lo": along(slice(0, h)),
        "halo_hi": along(slice(h + n, n + 2 * h)),
        "edge_lo": along(slice(h, 2 * h)),
        "edge_hi": along(slice(n, n + h)),
    }


def _tag(axis: int, upward: bool) -> int:
    # A message to the high neighbour travels "up"; the receiver expects it from its low side.
    return 2 * axis + (0 if upward else 1)


Landed = list[tuple[tuple[slice, ...], torch.Tensor]]
LowHigh = tuple[tuple[slice, ...], tuple[slice, ...]]  # a slab on the low side, one on the high


def _post(
    t: torch.Tensor, grid: ProcessGrid, axis: int, send: LowHigh, recv: LowHigh
) -> tuple[Pending, Landed]:
    """Post sends of ``t[send[lo/hi]]`` to the low/high neighbour and receives into fresh
    buffers for ``t[recv[lo/hi]]``; all transfers along the axis are posted before any is
    waited for, so the two directions cannot deadlock. Returns the pending transfers and
    ``(where, buffer)`` of what lands after the wait. Buffers hold the slabs in ``t``'s
    layout (:func:`_wire`): a slab and its neighbour's have one shape, so their bytes line up."""
    lead = (slice(None),) * (t.dim() - grid.ndim)
    layout = layout_of(t)
    sends, recvs, landed = [], [], []
    for side, peer in enumerate(grid.neighbours[axis]):
        if peer is None:
            continue
        upward = side == 1
        shape = _wire(t[lead + recv[side]], layout).shape
        buf = torch.empty(shape, dtype=t.dtype, device=t.device)
        recvs.append((peer, buf, _tag(axis, not upward)))
        landed.append((recv[side], _unwire(buf, layout)))
        packed = _wire(t[lead + send[side]], layout).contiguous()
        sends.append((peer, packed, _tag(axis, upward)))
    # Waits carry the grid's timeout: a dead or stalled peer cannot hang us.
    return start_exchange(sends, recvs, grid.spatial_group, grid.timeout), landed


def _land(t: torch.Tensor, grid: ProcessGrid, landed: Landed, accumulate: bool) -> None:
    """Copy (``accumulate=False``) or add the received buffers into their slabs of ``t``."""
    lead = (slice(None),) * (t.dim() - grid.ndim)
    for where, buf in landed:
        if accumulate:
            t[lead + where] += buf
        else:
            t[lead + where] = buf


def _swap(
    t: torch.Tensor, grid: ProcessGrid, axis: int, send: LowHigh, recv: LowHigh, accumulate: bool
) -> None:
    """Send ``t[send[lo/hi]]`` to the low/high neighbour, receive into ``t[recv[lo/hi]]``
    (copied, or added with ``accumulate``, which is the backward)."""
    pending, landed = _post(t, grid, axis, send, recv)
    wait_clock.wait(pending, backward=accumulate)
    _land(t, grid, landed, accumulate)


def _check(x: torch.Tensor, grid: ProcessGrid, halo: Sequence[int]) -> tuple[int, ...]:
    halo = tuple(int(h) for h in halo)
    if len(halo) != grid.ndim:
        raise ValueError(f"halo {halo} needs one width per grid axis ({grid.ndim})")
    if any(h < 0 for h in halo):
        raise ValueError(f"halo widths must be >= 0, got {halo}")
    if x.dim() < grid.ndim:
        raise ValueError(f"a {x.dim()}-axis tensor has no {grid.ndim} spatial axes")
    return halo


def _pad_spec(halo: Sequence[int]) -> list[int]:
    # F.pad lists the last axis first.
    return [w for h in reversed(halo) for w in (h, h)]


def exchange_axes(grid: ProcessGrid, halo: Sequence[int]) -> list[int]:
    """The axes that exchange anything: split (``parts > 1``) with a halo ``> 0``."""
    return [a for a in range(grid.ndim) if halo[a] > 0 and grid.parts[a] > 1]


def _exchange(t: torch.Tensor, grid: ProcessGrid, halo: tuple[int, ...], axes: Sequence[int]):
    """``E_k`` for ``k`` in ``axes`` (in order) on the padded block ``t``, in place."""
    owned = tuple(n - 2 * h for n, h in zip(t.shape[-grid.ndim :], halo, strict=True))
    for axis in axes:
        s = exchange_slices(owned, halo, axis)
        _swap(t, grid, axis, (s["edge_lo"], s["edge_hi"]), (s["halo_lo"], s["halo_hi"]), False)


def _pad(x: torch.Tensor, halo: tuple[int, ...]) -> torch.Tensor:
    """``P``: a new tensor, ``x`` zero-padded by ``halo``."""
    return F.pad(x, _pad_spec(halo)) if any(halo) else x.clone()


def _forward(x: torch.Tensor, grid: ProcessGrid, halo: tuple[int, ...]) -> torch.Tensor:
    t = _pad(x, halo)
    _exchange(t, grid, halo, exchange_axes(grid, halo))
    return t


def _adjoint_exchange(
    g: torch.Tensor, grid: ProcessGrid, halo: tuple[int, ...], axes, layout: torch.memory_format
):
    """``E_k^T`` for ``k`` in ``reversed(axes)`` on a copy of the padded gradient ``g``, in
    ``layout``."""
    padded = tuple(g.shape[-grid.ndim :])
    owned = tuple(n - 2 * h for n, h in zip(padded, halo, strict=True))
    g = g.clone(memory_format=layout)
    lead = (slice(None),) * (g.dim() - grid.ndim)
    for axis in reversed(axes):
        s = exchange_slices(owned, halo, axis)
        halos = (s["halo_lo"], s["halo_hi"])
        # Receive into fresh buffers before zeroing: _swap sends copies, then adds.
        _swap(g, grid, axis, halos, (s["edge_lo"], s["edge_hi"]), True)
        for side, peer in enumerate(grid.neighbours[axis]):
            if peer is not None:
                g[lead + halos[side]] = 0
    return g


def _crop(
    g: torch.Tensor, grid: ProcessGrid, halo: tuple[int, ...], layout: torch.memory_format
) -> torch.Tensor:
    """``P^T``: drop the halo; dense in ``layout``."""
    padded = tuple(g.shape[-grid.ndim :])
    lead = (slice(None),) * (g.dim() - grid.ndim)
    inner = tuple(slice(h, n - h) for n, h in zip(padded, halo, strict=True))
    return g[lead + inner].contiguous(memory_format=layout)


def _adjoint(g: torch.Tensor, grid: ProcessGrid, halo: tuple[int, ...], layout) -> torch.Tensor:
    axes = exchange_axes(grid, halo)
    return _crop(_adjoint_exchange(g, grid, halo, axes, layout), grid, halo, layout)


class HaloExchange(torch.autograd.Function):
    """``H`` and ``H^T`` of the module docstring; call it through :func:`halo_exchange`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, grid: ProcessGrid, halo: tuple[int, ...]):
        ctx.grid, ctx.halo, ctx.layout = grid, halo, layout_of(x)
        return _forward(x, grid, halo)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _adjoint(grad, ctx.grid, ctx.halo, ctx.layout), None, None


def halo_exchange(x: torch.Tensor, grid: ProcessGrid, halo: Sequence[int]) -> torch.Tensor:
    """The block ``x`` with a halo of ``halo[axis]`` voxels per side filled by its neighbours.

    Collective over ``grid.spatial_group``: every rank of it must call it with the same
    ``halo``.

    Args:
        x: ``(..., *owned)``; the last ``grid.ndim`` axes are spatial, in grid-axis order.
        grid: this rank's process grid.
        halo: width per spatial axis.

    Returns:
        ``(..., *(owned + 2 * halo))``, differentiable (backward is the exact adjoint).
    """
    return HaloExchange.apply(x, grid, _check(x, grid, halo))


@dataclass(eq=False)
class StartedHalo:
    """A halo exchange between :func:`start_halo_exchange` and :func:`finish_halo_exchange`.

    Attributes:
        grid, halo: as given to ``start``.
        axes: the exchanging axes (:func:`exchange_axes`); ``axes[0]`` is posted by ``start``.
        pending, landed: the posted transfers of ``axes[0]`` and where their buffers land.
        finished: set by ``finish`` (a started exchange is finished once).
    """

    grid: ProcessGrid
    halo: tuple[int, ...]
    axes: list[int]
    pending: Pending | None = None
    landed: Landed = field(default_factory=list)
    finished: bool = False


class _HaloStart(torch.autograd.Function):
    """``P`` (backward ``P^T``); posts the first axis' exchange from the padded block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, started: StartedHalo):
        ctx.grid, ctx.halo, ctx.layout = started.grid, started.halo, layout_of(x)
        t = _pad(x, started.halo)
        if started.axes:
            axis = started.axes[0]
            s = exchange_slices(tuple(x.shape[-started.grid.ndim :]), started.halo, axis)
            edges, halos = (s["edge_lo"], s["edge_hi"]), (s["halo_lo"], s["halo_hi"])
            started.pending, started.landed = _post(t, started.grid, axis, edges, halos)
        return t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _crop(grad, ctx.grid, ctx.halo, ctx.layout), None


class _HaloFinish(torch.autograd.Function):
    """``E_{d-1} ... E_j`` with ``E_j`` posted by ``_HaloStart`` (backward: their adjoints)."""

    @staticmethod
    def forward(ctx: Any, padded: torch.Tensor, started: StartedHalo):
        grid, halo, axes = started.grid, started.halo, started.axes
        ctx.grid, ctx.halo, ctx.axes, ctx.layout = grid, halo, axes, layout_of(padded)
        t = padded.clone(memory_format=torch.preserve_format)  # the input stays P x
        if axes:
            assert started.pending is not None
            wait_clock.wait(started.pending)
            _land(t, grid, started.landed, False)
            _exchange(t, grid, halo, axes[1:])
        started.pending, started.landed, started.finished = None, [], True
        return t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _adjoint_exchange(grad, ctx.grid, ctx.halo, ctx.axes, ctx.layout), None


def start_halo_exchange(
    x: torch.Tensor, grid: ProcessGrid, halo: Sequence[int]
) -> tuple[torch.Tensor, StartedHalo]:
    """Zero-pad ``x`` by ``halo`` and post the exchange of the first exchanging axis.

    Collective over ``grid.spatial_group`` as :func:`halo_exchange`; every rank must then call
    :func:`finish_halo_exchange` (once) on what this returns.

    Returns:
        ``(padded, started)``: ``padded`` is ``P x``, differentiable (its halos are zero and
        must not be read as halos, nor written: the transfers posted read its edge slabs);
        ``started`` is the handle for ``finish``.
    """
    halo = _check(x, grid, halo)
    started = StartedHalo(grid, halo, exchange_axes(grid, halo))
    return _HaloStart.apply(x, started), started


def finish_halo_exchange(padded: torch.Tensor, started: StartedHalo) -> torch.Tensor:
    """Wait for the first axis, exchange the others; ``H x`` from ``padded = P x``.

    Args:
        padded: the first output of :func:`start_halo_exchange`.
        started: its second output.

    Returns:
        A new tensor equal to ``halo_exchange(x)``; differentiable, with the exact adjoint
        (not overlapped: the backward exchanges block).
    """
    if started.finished:
        raise RuntimeError("this halo exchange was already finished")
    return _HaloFinish.apply(padded, started)

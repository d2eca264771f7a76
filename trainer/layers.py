"""Spatially parallel layers: a 3-D convolution over blocks of a volume split by a ProcessGrid.

``DistConv3d`` computes, on every rank, its owned block of ``Conv3d(k, stride, padding=k // 2)``
applied to the whole volume (zero padding at the global boundary): a halo exchange of ``k // 2``
voxels per side (``trainer.halo``), then a local "valid" convolution of the padded block. With
stride ``s`` the rank owns the outputs whose anchor ``o * s`` lies in its block, so every block
but the last along a split axis must have a multiple of ``s`` voxels (checked); the valid
convolution gives exactly those ``ceil(n / s)`` outputs (output ``o`` reads ``[o * s, o * s +
k)`` of the ``n + k - 1`` padded voxels; ``trainer.geometry.conv_window`` says which ones they
read, at most the padded block). Its forward and every gradient equal the single-process layer's
(tests/test_trainer_halo.py, tests/test_trainer_layers.py):

- the input gradient comes back through the halo exchange's adjoint (halo gradients are added
  into their owners);
- a weight or bias gradient on one rank is the contribution of its block only; the gradient of
  the whole sample is their sum over the spatial group (:func:`sum_spatial_grads`), to be
  averaged over the data group afterwards as in plain data parallelism.

Overlap (``overlap=True``, the default; stride 1 on every axis and at least one exchanging axis)
    The forward hides the first exchanging axis' halo transfer behind the *interior* outputs,
    those a valid convolution of the owned block alone gives (``trainer.geometry.interior_box``
    with every side excluded): zero-pad the block, post the first axis' exchange
    (``trainer.halo.start_halo_exchange``), convolve the interior from the block itself, wait,
    exchange the other axes (blocking, one after another, so that corners arrive by hops), then
    convolve the *shell* (``trainer.geometry.shell_slabs``, at most two slabs per axis, each
    from a copy of its thin input window) and concatenate. Backward keeps the block and the
    shell windows, not the padded block. The
    exchanges of the second and third split axes are not overlapped, nor is any part of the
    backward: the halo's adjoint runs blocking as without overlap. Outputs and gradients are
    those of the path without overlap up to rounding (the same sums, cut into pieces).
    Strided layers, and blocks with no split axis, take the path without overlap.

Memory format: outputs, the input gradient and every piece between them keep the input's
layout (``channels_last_3d`` on a GPU in the trainer; give the weights the same, as
``model.to(memory_format=...)`` does, or cuDNN converts them every call): the halo exchange
keeps it (``trainer.halo``), the shell windows are copied in it and their gradients gathered
into one zero tensor in it, and the interior and shell outputs, all from the same convolution
on inputs of one layout, are concatenated without conversion.

Weights are equal on every rank: broadcast from global rank 0 when the layer is built (under
NCCL a layer built on the CPU, the default, travels through a copy on the rank's GPU).
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.agree import AgreedShapes
from trainer.comm import all_reduce_sum, backend_of, broadcast
from trainer.geometry import (
    box_size,
    check_conv_block,
    conv_input_box,
    interior_box,
    shell_slabs,
)
from trainer.grid import DEFAULT_TIMEOUT, ProcessGrid
from trainer.halo import (
    exchange_axes,
    finish_halo_exchange,
    halo_exchange,
    layout_of,
    start_halo_exchange,
)

__all__ = ["DistConv3d", "broadcast_parameters", "sum_spatial_grads", "travel_device"]


def _triple(k: int | Sequence[int]) -> tuple[int, int, int]:
    ks = (int(k),) * 3 if isinstance(k, int) else tuple(int(v) for v in k)
    if len(ks) != 3 or any(v < 1 or v % 2 == 0 for v in ks):
        raise ValueError(f"kernel_size must be one odd size or three, got {k!r}")
    return ks  # type: ignore[return-value]


def _strides(s: int | Sequence[int]) -> tuple[int, int, int]:
    ss = (int(s),) * 3 if isinstance(s, int) else tuple(int(v) for v in s)
    if len(ss) != 3 or any(v < 1 for v in ss):
        raise ValueError(f"stride must be one size >= 1 or three, got {s!r}")
    return ss  # type: ignore[return-value]


def travel_device(t: torch.Tensor, backend: str, gpu: torch.device | None) -> torch.device:
    """Where ``t`` can travel over a group of ``backend``: where it lies, but on ``gpu`` for a
    CPU tensor over NCCL (which moves device memory only; gloo takes both, CUDA staged)."""
    if t.device.type != "cpu" or backend != "nccl":
        return t.device
    if gpu is None:
        raise ValueError("a CPU tensor over NCCL needs the rank's GPU, got none")
    return gpu


def _group_gpu(group: Any) -> torch.device | None:
    """The GPU of ``group``: the one bound by ``init_process_group(device_id=)``, else the
    current CUDA device (as ``torch.distributed`` picks it); ``None`` without CUDA."""
    bound = getattr(group or dist.group.WORLD, "bound_device_id", None)
    if bound is not None:
        return bound
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def broadcast_parameters(
    module: nn.Module, src: int = 0, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> None:
    """Copy every parameter and buffer of ``module`` from global rank ``src`` to all ranks.

    Each tensor travels where the default group's backend can move it (``travel_device``): a
    CPU tensor over NCCL through a copy on the rank's GPU, so a module built on the CPU (the
    default ``device=None``) is broadcast under NCCL as under gloo.
    """
    if not dist.is_initialized():
        return
    backend, gpu = backend_of(None), _group_gpu(None)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            where = travel_device(t, backend, gpu)
            if where == t.device:
                broadcast(t.data, src, None, timeout)
            else:
                buf = t.data.to(where)
                broadcast(buf, src, None, timeout)
                t.data.copy_(buf)


def sum_spatial_grads(params: Iterable[nn.Parameter], grid: ProcessGrid) -> None:
    """Sum the gradients of ``params`` over ``grid.spatial_group`` (in place).

    After it every rank of a sample holds the whole sample's gradient of a spatially split layer.
    Parameters without a gradient are skipped (every rank must skip the same ones).
    """
    for p in params:
        if p.grad is not None:
            all_reduce_sum(p.grad, grid.spatial_group, grid.timeout)


def _check_block(owned, coords, *, parts, stride, halo) -> None:
    check_conv_block(owned, parts, coords, stride, halo, "DistConv3d")


class _Windows(torch.autograd.Function):
    """Copies of ``windows`` of ``t`` in its layout, each its own tensor (backward keeps those
    thin slabs alive, not ``t``). Backward adds their gradients into one zero tensor in ``t``'s
    layout (autograd's slicing would build a contiguous one per window)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, windows: list[tuple[slice, ...]]):
        ctx.windows, ctx.layout = windows, layout_of(t)
        ctx.shape, ctx.dtype, ctx.device = t.shape, t.dtype, t.device
        return tuple(t[(..., *w)].clone() for w in windows)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor):
        g = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device, memory_format=ctx.layout)
        g.zero_()
        for w, gw in zip(ctx.windows, grads, strict=True):
            g[(..., *w)] += gw
        return g, None


class DistConv3d(nn.Module):
    """``Conv3d`` with global "same" zero padding over a spatially split ``(N, C, D, H, W)``.

    Any stride; dilation 1 and one group for now.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        kernel_size: one odd size or three.
        grid: this rank's process grid (3 spatial axes).
        stride: one stride or three. Default: ``1``.
        bias: learn a bias. Default: ``True``.
        broadcast: copy the weights from global rank 0 at construction (collective over the
            default group, gloo or NCCL, wherever the weights lie: :func:`broadcast_parameters`).
            Default: ``True``; pass ``False`` when weights are loaded afterwards on every rank,
            or were seeded identically.
        overlap: overlap the first split axis' halo transfer with the interior outputs in
            forward (stride 1 only; see the module docstring; the backward is not overlapped).
            Default: ``True``. Host
            seconds blocked in halo waits add up in ``trainer.halo.wait_clock`` either way.
        device, dtype: of the parameters. Default: torch's defaults.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | Sequence[int],
        grid: ProcessGrid,
        *,
        stride: int | Sequence[int] = 1,
        bias: bool = True,
        broadcast: bool = True,
        overlap: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if grid.ndim != 3:
            raise ValueError(f"DistConv3d needs a grid with 3 spatial axes, got parts {grid.parts}")
        ks = _triple(kernel_size)
        self.grid = grid
        self.halo = tuple(k // 2 for k in ks)
        self.stride = _strides(stride)
        self.overlap = bool(overlap)
        self.conv = nn.Conv3d(
            in_channels,
            out_channels,
            ks,
            stride=self.stride,
            padding=0,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.agreed = AgreedShapes("DistConv3d")
        if broadcast:
            broadcast_parameters(self.conv, timeout=grid.timeout)

    @property
    def weight(self) -> nn.Parameter:
        return self.conv.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C_in, *owned)`` to ``(N, C_out, *ceil(owned / stride))``: this rank's output block.

        The first call with a new input shape agrees on it over the spatial group
        (``trainer.agree``: one small all-gather); later calls with it communicate nothing
        but the halos.

        Raises:
            ValueError: on every rank of the spatial group at once, before any halo moves, if
                any rank's block is refused: a block that is not the last along a split axis
                with a number of voxels that is not a multiple of the stride, one shorter than
                the halo along a split axis, leading axes that differ, blocks that do not tile
                a volume. The message names the refused ranks and every rank's input shape.
        """
        g = self.grid
        check = functools.partial(_check_block, parts=g.parts, stride=self.stride, halo=self.halo)
        self.agreed.check(x, g, check)
        if self.overlapped():
            return self._overlapped_forward(x)
        # The whole padded block, not a slice of it: its valid convolution gives exactly the
        # owned outputs (module docstring), and a slice's gradient would be built contiguous.
        return self.conv(halo_exchange(x, g, self.halo))

    def overlapped(self) -> bool:
        """Whether ``forward`` overlaps the halo exchange (``overlap``, stride 1, a split axis)."""
        stride1 = all(s == 1 for s in self.stride)
        return self.overlap and stride1 and bool(exchange_axes(self.grid, self.halo))

    def _overlapped_forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        owned = tuple(x.shape[-3:])
        # The interior is what the owned voxels alone give: a valid convolution of the block,
        # whatever the sides (the global boundary's zero padding is left to the shell), so it
        # reads x itself and backward keeps no padded copy for it.
        inner = interior_box(owned, self.halo, [(h > 0, h > 0) for h in self.halo])
        padded, started = start_halo_exchange(x, g, self.halo)
        # Reads owned voxels only: runs while the first axis travels.
        core = F.conv3d(x, self.conv.weight, self.conv.bias) if box_size(inner) else None
        full = finish_halo_exchange(padded, started)
        # The shell's stride-1 outputs, each a valid convolution of a copy of its window.
        slabs = {(axis, side): box for axis, side, box in shell_slabs(owned, inner)}
        windows = [
            tuple(slice(a, b) for a, b in conv_input_box(box, self.halo)) for box in slabs.values()
        ]
        copies = _Windows.apply(full, windows) if windows else ()
        w, b = self.conv.weight, self.conv.bias
        shell = {k: F.conv3d(c, w, b) for k, c in zip(slabs, copies, strict=True)}
        for axis in reversed(range(3)):
            pieces = [shell.get((axis, 0)), core, shell.get((axis, 1))]
            pieces = [p for p in pieces if p is not None]
            if len(pieces) > 1:
                core = torch.cat(pieces, dim=x.dim() - 3 + axis)
            elif pieces:
                core = pieces[0]
        assert core is not None and tuple(core.shape[-3:]) == owned
        return core

    def extra_repr(self) -> str:
        g = self.grid
        where = f"parts={g.parts}, spatial_rank={g.spatial_rank}"
        return f"{where}, halo={self.halo}, stride={self.stride}, overlap={self.overlapped()}"

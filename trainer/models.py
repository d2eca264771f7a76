"""3-D CNNs built from a layer factory: ``CosmoFlow`` (regression) and ``UNet3D`` (voxel maps).

The models never construct a layer that touches the spatial axes themselves: they ask a
``layers`` object (:class:`TorchLayers` by default, single process) for convolutions, pooling,
normalisation, upsampling and the first dense layer (over the flattened volume). A spatially
distributed factory with the same methods (``DistConv3d`` etc.) plugs in without changing the
models.
Element-wise layers (activations, dropout) and channel concatenation act on each block alone,
so the models create them directly.

``CosmoFlow`` follows the MLPerf HPC reference (``mlcommons/hpc``, ``cosmoflow/models/
cosmoflow.py``, ``build_model``): ``n_conv`` blocks of a "same" convolution with
``conv_size * 2**i`` filters, LeakyReLU and a 2x max-pool; flatten; dense ``fc1`` and ``fc2``
with LeakyReLU and dropout; a dense output with ``tanh`` scaled by 1.2 (``scale_1p2``).
Differences: the kernel is 3 (the reference's default is 2; an odd kernel keeps "same"
padding symmetric, which the halo exchange needs), and the width ``conv_size`` is an argument
(the reference's configs use 32; small values train on a CPU).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from trainer.dense import FlattenLinear

__all__ = ["CosmoFlow", "LayerFactory", "TorchLayers", "UNet3D", "count_parameters"]


class LayerFactory(Protocol):
    """The layers a model asks for; each returns a module acting on ``(N, C, D, H, W)``."""

    def conv3d(self, cin: int, cout: int, k: int, stride: int = 1) -> nn.Module: ...

    def maxpool3d(self, k: int) -> nn.Module: ...

    def batchnorm3d(self, c: int) -> nn.Module: ...

    def conv_transpose3d(self, cin: int, cout: int, k: int) -> nn.Module: ...

    def flatten_linear(self, channels: int, whole: tuple[int, ...], out: int) -> nn.Module: ...


class TorchLayers:
    """The single-process factory: plain ``torch.nn`` layers.

    ``conv3d`` pads ``k // 2`` ("same" for odd ``k`` at stride 1); ``maxpool3d(k)`` has stride
    ``k``; ``conv_transpose3d(cin, cout, k)`` has stride ``k`` (upsampling by ``k``);
    ``flatten_linear(channels, whole, out)`` is ``nn.Linear`` of the input flattened after the
    batch axis (:class:`~trainer.dense.FlattenLinear`).
    """

    def conv3d(self, cin: int, cout: int, k: int, stride: int = 1) -> nn.Module:
        return nn.Conv3d(cin, cout, k, stride=stride, padding=k // 2)

    def maxpool3d(self, k: int) -> nn.Module:
        return nn.MaxPool3d(k)

    def batchnorm3d(self, c: int) -> nn.Module:
        return nn.BatchNorm3d(c)

    def conv_transpose3d(self, cin: int, cout: int, k: int) -> nn.Module:
        return nn.ConvTranspose3d(cin, cout, k, stride=k)

    def flatten_linear(self, channels: int, whole: tuple[int, ...], out: int) -> nn.Module:
        return FlattenLinear(channels, whole, out)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars in ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class CosmoFlow(nn.Module):
    """The CosmoFlow regression CNN (MLPerf HPC reference layout; module docstring).

    Args:
        in_channels: input channels. Default: ``4``.
        n_out: outputs (targets in ``[-1, 1]``). Default: ``4``.
        input_size: cube side of the input; must be divisible by ``2**n_conv``. Default: ``128``.
        conv_size: filters of the first block, doubled at every block. Default: ``32``.
        n_conv: convolution blocks. Default: ``5``.
        kernel_size: odd convolution kernel. Default: ``3``.
        fc1, fc2: widths of the dense layers. Default: ``128``, ``64``.
        dropout: after each dense hidden layer. Default: ``0.0``.
        layers: the layer factory. Default: :class:`TorchLayers`.
    """

    def __init__(
        self,
        in_channels: int = 4,
        n_out: int = 4,
        *,
        input_size: int = 128,
        conv_size: int = 32,
        n_conv: int = 5,
        kernel_size: int = 3,
        fc1: int = 128,
        fc2: int = 64,
        dropout: float = 0.0,
        layers: LayerFactory | None = None,
    ) -> None:
        super().__init__()
        layers = TorchLayers() if layers is None else layers
        if input_size % 2**n_conv:
            raise ValueError(f"input_size {input_size} is not divisible by 2**n_conv={2**n_conv}")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {kernel_size}")
        blocks: list[nn.Module] = []
        cin = in_channels
        for i in range(n_conv):
            cout = conv_size * 2**i
            blocks += [layers.conv3d(cin, cout, kernel_size), nn.LeakyReLU(), layers.maxpool3d(2)]
            cin = cout
        self.features = nn.Sequential(*blocks)
        whole = (input_size // 2**n_conv,) * 3
        self.head = nn.Sequential(
            layers.flatten_linear(cin, whole, fc1), nn.LeakyReLU(), nn.Dropout(dropout),
            nn.Linear(fc1, fc2), nn.LeakyReLU(), nn.Dropout(dropout),
            nn.Linear(fc2, n_out), nn.Tanh(),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C, S, S, S)`` to ``(N, n_out)`` in ``[-1.2, 1.2]``."""
        return 1.2 * self.head(self.features(x))


class _DoubleConv(nn.Sequential):
    def __init__(self, layers: LayerFactory, cin: int, cout: int) -> None:
        super().__init__(
            layers.conv3d(cin, cout, 3), layers.batchnorm3d(cout), nn.ReLU(),
            layers.conv3d(cout, cout, 3), layers.batchnorm3d(cout), nn.ReLU(),
        )  # fmt: skip


class UNet3D(nn.Module):
    """A small 3-D U-Net: voxel-wise maps of the input's size.

    Encoder: ``depth + 1`` levels of two (conv 3, BatchNorm, ReLU), with ``base * 2**i``
    channels, a 2x max-pool between levels. Decoder: a stride-2 transposed convolution, the
    encoder's skip concatenated on channels, two (conv, BatchNorm, ReLU); a final 1x1 conv.

    Args:
        in_channels: input channels. Default: ``4``.
        out_channels: output channels. Default: ``1``.
        base: channels of the first level. Default: ``8``.
        depth: poolings (the input side must be divisible by ``2**depth``). Default: ``3``.
        residual: add the input to the output (``in_channels == out_channels``): the network
            learns the correction, as denoisers do; the last convolution starts at zero, so the
            untrained model is the identity. Default: ``False``.
        layers: the layer factory. Default: :class:`TorchLayers`.
    """

    def __init__(
        self,
        in_channels: int = 4,
        out_channels: int = 1,
        *,
        base: int = 8,
        depth: int = 3,
        residual: bool = False,
        layers: LayerFactory | None = None,
    ) -> None:
        super().__init__()
        layers = TorchLayers() if layers is None else layers
        if residual and in_channels != out_channels:
            raise ValueError(
                f"residual needs in_channels == out_channels, got {in_channels}, {out_channels}"
            )
        self.depth, self.residual = depth, residual
        widths = [base * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList()
        cin = in_channels
        for w in widths:
            self.down.append(_DoubleConv(layers, cin, w))
            cin = w
        self.pool = nn.ModuleList(layers.maxpool3d(2) for _ in range(depth))
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for w in reversed(widths[:-1]):
            self.up.append(layers.conv_transpose3d(2 * w, w, 2))
            self.merge.append(_DoubleConv(layers, 2 * w, w))
        self.out = layers.conv3d(widths[0], out_channels, 1)
        if residual:  # start as the identity: the correction grows from zero
            with torch.no_grad():
                self.out.weight.zero_()
                self.out.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, C_in, D, H, W)`` to ``(N, C_out, D, H, W)``."""
        if any(s % 2**self.depth for s in x.shape[2:]):
            raise ValueError(f"spatial shape {tuple(x.shape[2:])} not divisible by 2**depth")
        skips, inputs = [], x
        for i, block in enumerate(self.down):
            x = block(x)
            if i < self.depth:
                skips.append(x)
                x = self.pool[i](x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        out = self.out(x)
        return out + inputs if self.residual else out

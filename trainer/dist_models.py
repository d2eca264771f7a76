"""``DistLayers``: the layer factory of a spatially split model (``trainer.models``).

A model built with ``DistLayers(grid, stats_group)`` instead of ``TorchLayers`` computes, on
every rank, this rank's block of every activation of the single-process model, and the whole
output of the first dense layer (``flatten_linear``, whose weight is split by its input
features), so the rest of the dense head, which the model creates itself, is replicated over
the spatial group:

- ``conv3d`` is :class:`~trainer.layers.DistConv3d` (halo exchange, any stride);
- ``maxpool3d`` is :class:`~trainer.pool.DistMaxPool3d` (local);
- ``batchnorm3d`` is :class:`~trainer.norm.DistBatchNorm3d` over ``stats_group``;
- ``conv_transpose3d(cin, cout, k)`` (stride ``k``) is a plain ``nn.ConvTranspose3d``: its
  output windows do not overlap, so each block's output is its own block of the whole output;
- ``flatten_linear`` is :class:`~trainer.dense.DistFlattenLinear`: each rank holds the
  weight's columns of its own block's features, and the partial products are summed over the
  spatial group.

The parameters of the convolutions and norms see only this rank's block: their gradients are
partial sums over the spatial group (:meth:`DistLayers.spatially_partial`, to pass to
``GradientReducer(spatially_partial=...)``). The first dense layer's columns and the replicated
head's parameters get whole-sample gradients already. Parameters are initialised from the
torch RNG exactly as ``TorchLayers`` would (seed every rank alike), not broadcast.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainer.dense import DistFlattenLinear
from trainer.grid import ProcessGrid
from trainer.layers import DistConv3d
from trainer.norm import DistBatchNorm3d
from trainer.pool import DistMaxPool3d

__all__ = ["DistLayers"]


class DistLayers:
    """The spatially split factory (module docstring).

    Args:
        grid: this rank's process grid (3 spatial axes).
        stats_group: the group BatchNorm statistics span: ``grid.spatial_group`` (per replica)
            or a group of whole spatial groups, e.g. ``torch.distributed.group.WORLD``.
        overlap: the convolutions overlap their halo transfer with the interior
            (``DistConv3d(overlap=...)``). Default: ``True``.
    """

    def __init__(self, grid: ProcessGrid, stats_group: Any, *, overlap: bool = True) -> None:
        self.grid = grid
        self.stats_group = stats_group
        self.overlap = overlap
        self._made: list[nn.Module] = []

    def _keep(self, module: nn.Module) -> nn.Module:
        self._made.append(module)
        return module

    def conv3d(self, cin: int, cout: int, k: int, stride: int = 1) -> nn.Module:
        conv = DistConv3d(cin, cout, k, self.grid, stride=stride, broadcast=False,
                          overlap=self.overlap)  # fmt: skip
        return self._keep(conv)

    def maxpool3d(self, k: int) -> nn.Module:
        return DistMaxPool3d(k, self.grid)

    def batchnorm3d(self, c: int) -> nn.Module:
        return self._keep(DistBatchNorm3d(c, self.grid, stats_group=self.stats_group))

    def conv_transpose3d(self, cin: int, cout: int, k: int) -> nn.Module:
        return self._keep(nn.ConvTranspose3d(cin, cout, k, stride=k))

    def flatten_linear(self, channels: int, whole: tuple[int, ...], out: int) -> nn.Module:
        return DistFlattenLinear(channels, whole, out, self.grid)

    def spatially_partial(self) -> list[nn.Parameter]:
        """Parameters of the layers made so far whose gradients are per-block partial sums."""
        return [p for m in self._made for p in m.parameters()]

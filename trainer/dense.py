"""The first dense layer after a spatially split volume, split by its input features.

A spatially split CosmoFlow ends with ``flatten`` and a dense layer of ``C * prod(whole)``
inputs: at 192^3 with 4 blocks, 442,368 features to 128, 56.6 M of the model's 57.8 M
parameters. Replicated, every rank would hold that weight, its gradient, its optimizer state and
autocast's bf16 copy whatever the split (about 1 GiB a rank at 192^3), so a split would save
only what is per voxel. :class:`DistFlattenLinear` keeps on each rank the weight's columns of
its own block's features alone (:func:`block_columns`): forward multiplies the rank's flattened
block by them, sums the partial products over the spatial group (one all-reduce of
``N x out_features``, where gathering the whole volume moved ``N x in_features``) and adds the
replicated bias; backward gives each rank its columns' gradient, complete (the head after it is
replicated, so every rank gets the same output gradient: the sum's backward is the identity)
and its block's input gradient.

A rank's columns and their optimizer state are its own: checkpoints hold the whole weight.
:func:`whole_model_state` and :func:`whole_optimizer_state` gather it on the first rank of the
spatial group, the one that writes (collectives over the spatial group, on every rank: the
others send their columns and assemble nothing), loading a whole weight takes this rank's columns
(:meth:`DistFlattenLinear._load_from_state_dict`, :func:`own_optimizer_state`): a checkpoint
holds the same whole weight whatever the split it was written or is read with. LARS's trust
ratio takes the whole weight's norms (:func:`whole_norms`), not the rank's columns'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from datastore.maths.partition import Grid, block_bounds
from trainer.comm import all_reduce_sum, exchange
from trainer.grid import ProcessGrid
from trainer.optim import Norms, local_norms
from trainer.pool import block_shapes

__all__ = [
    "DistFlattenLinear",
    "FlattenLinear",
    "block_columns",
    "own_optimizer_state",
    "whole_model_state",
    "whole_norms",
    "whole_optimizer_state",
]


class FlattenLinear(nn.Linear):
    """``nn.Linear(channels * prod(whole), out_features)`` of ``torch.flatten(x, 1)`` over a
    ``(N, channels, *whole)`` input: the single-process first dense layer."""

    def __init__(self, channels: int, whole: Sequence[int], out_features: int) -> None:
        super().__init__(channels * math.prod(whole), out_features)
        self.channels, self.whole = channels, tuple(whole)

    def rank_weights(self, parts: Sequence[int]) -> int:
        """Weights the split form holds on the rank of the largest block, split ``parts``."""
        largest = [-(-n // p) for n, p in zip(self.whole, parts, strict=True)]
        return self.out_features * self.channels * math.prod(largest)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(1))


def block_columns(channels: int, whole: Sequence[int], block: Sequence[slice]) -> torch.Tensor:
    """The features of ``block`` in ``torch.flatten`` of a ``(channels, *whole)`` volume, in
    the order ``torch.flatten`` of the block's own ``(channels, *block)`` gives them."""
    index = torch.arange(channels * math.prod(whole)).reshape(channels, *whole)
    return index[(slice(None), *block)].reshape(-1)


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum over ``group``. Backward: the identity (a replicated consumer)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, timeout: Any) -> torch.Tensor:
        return all_reduce_sum(t.clone(), group, timeout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None, None


class DistFlattenLinear(nn.Module):
    """``Linear(channels * prod(whole), out_features)`` of the flattened whole volume, on a
    rank that holds one block of it (module docstring).

    The weight is drawn whole from the torch RNG, exactly as ``nn.Linear`` (and so
    :class:`FlattenLinear`) would, and this rank keeps its block's columns: ranks seeded alike
    hold the single-process weight between them.

    Args:
        channels: the volume's channels.
        whole: its spatial shape (the model's features after the last pooling).
        out_features: the layer's outputs.
        grid: this rank's process grid; blocks in C order over ``grid.parts``, as the loader
            splits the sample.
    """

    def __init__(
        self, channels: int, whole: Sequence[int], out_features: int, grid: ProcessGrid
    ) -> None:
        super().__init__()
        self.grid = grid
        self.channels, self.whole = channels, tuple(whole)
        self.in_features, self.out_features = channels * math.prod(whole), out_features
        self.blocks = Grid(self.whole, tuple(grid.parts))  # refuses parts > whole, naming them
        self.expected = [  # every spatial rank's block, as its input must come
            tuple(s.stop - s.start for s in block_bounds(self.blocks, r))
            for r in range(self.blocks.nblocks)
        ]
        full = nn.Linear(self.in_features, out_features)
        cols = self.columns(grid.spatial_rank)
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def columns(self, spatial_rank: int) -> torch.Tensor:
        """The whole weight's columns that spatial rank ``spatial_rank`` holds."""
        return block_columns(self.channels, self.whole, block_bounds(self.blocks, spatial_rank))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.channels} x {self.whole}), "
            f"out_features={self.out_features}, columns here={self.weight.shape[1]}"
        )

    def _check(self, x: torch.Tensor) -> None:
        """Every rank's block is the one its columns belong to (one all-gather the first
        time a shape is seen, so every rank raises alike)."""
        shapes, want = block_shapes(x, self.grid), self.expected
        if x.dim() != len(self.whole) + 2 or x.shape[1] != self.channels or shapes != want:
            raise ValueError(
                f"DistFlattenLinear over a ({self.channels}, {self.whole}) volume split "
                f"{tuple(self.grid.parts)} expects blocks {want} of {self.channels} channels; "
                f"got {shapes} (this rank: shape {tuple(x.shape)})"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        flat = x.flatten(1)
        if self.grid.spatial_size == 1:
            return F.linear(flat, self.weight, self.bias)
        part = F.linear(flat, self.weight)
        acc = torch.promote_types(part.dtype, torch.float32)  # (bf16 partials summed in fp32)
        total = _SumOverGroup.apply(part.to(acc), self.grid.spatial_group, self.grid.timeout)
        return (total + self.bias.to(acc)).to(part.dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """A whole weight (a checkpoint) loads as this rank's columns."""
        key = prefix + "weight"
        w = state_dict.get(key)
        if isinstance(w, torch.Tensor) and tuple(w.shape) == (self.out_features, self.in_features):
            state_dict = {**state_dict, key: self.own_columns(w)}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def own_columns(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's columns of ``whole`` (``(out, in)``, the weight or state shaped like it):
        ``whole`` itself when the sample is not split (indexing copied all of it, one more
        whole weight at every resume)."""
        if self.grid.spatial_size == 1:
            return whole
        return whole[:, self.columns(self.grid.spatial_rank)]

    def gather_whole(self, t: torch.Tensor) -> torch.Tensor | None:
        """Collective over the spatial group: on its first rank (the one that writes
        checkpoints) the whole ``(out, in)`` tensor of which every rank holds its columns ``t``
        (the weight, or optimizer state shaped like it), on the CPU; ``None`` on the others,
        which only send their columns."""
        t = t.detach()
        if self.grid.spatial_size == 1:
            return t.cpu()
        group, timeout = self.grid.spatial_group, self.grid.timeout
        if self.grid.spatial_rank != 0:
            exchange([(0, t.contiguous(), 0)], [], group, timeout)
            return None
        cols = [self.columns(r) for r in range(self.grid.spatial_size)]
        pieces = [t] + [t.new_empty((t.shape[0], len(c))) for c in cols[1:]]
        exchange([], [(r, p, 0) for r, p in enumerate(pieces) if r], group, timeout)
        out = torch.empty((t.shape[0], self.in_features), dtype=t.dtype)
        for c, piece in zip(cols, pieces, strict=True):
            out[:, c] = piece.cpu()
        return out


def _split(model: nn.Module) -> dict[str, DistFlattenLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, DistFlattenLinear)}


def _owners(model: nn.Module) -> dict[int, DistFlattenLinear]:
    """``id(weight)`` -> its layer, for every split weight of ``model``."""
    return {id(m.weight): m for m in _split(model).values()}


def _writer(model: nn.Module) -> bool:
    """Whether this rank assembles the whole state: the first of every split layer's spatial
    group (every rank, when nothing is split)."""
    return all(m.grid.spatial_rank == 0 for m in _split(model).values())


def whole_model_state(model: nn.Module) -> dict[str, Any] | None:
    """``model.state_dict()`` with every :class:`DistFlattenLinear`'s whole weight, on the
    first rank of its spatial group (the one that writes checkpoints); ``None`` on the
    others. Collective over each such layer's spatial group: call it on every rank."""
    state = model.state_dict()
    for name, m in _split(model).items():
        state[f"{name}.weight" if name else "weight"] = m.gather_whole(m.weight)
    return state if _writer(model) else None


def whole_norms(model: nn.Module) -> Norms:
    """LARS's ``norms`` (``trainer.optim.LARS``) for ``model``: ``(||w||, ||g||)`` of a
    parameter and its gradient, of the whole weight for a :class:`DistFlattenLinear`'s columns
    (one all-reduce of the two squared norms over its spatial group: every rank of the group
    asks for them in the same order, as an optimizer's step does)."""
    owner = _owners(model)

    def norms(w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = owner.get(id(w))
        w_norm, g_norm = local_norms(w, g)
        if m is None or m.grid.spatial_size == 1:
            return w_norm, g_norm
        squares = torch.stack([w_norm, g_norm]).square()
        squares = all_reduce_sum(squares, m.grid.spatial_group, m.grid.timeout)
        return squares[0].sqrt(), squares[1].sqrt()

    return norms


def _sharded(model: nn.Module, opt: torch.optim.Optimizer) -> dict[int, DistFlattenLinear]:
    """Optimizer state index -> the layer, for every split weight among ``opt``'s parameters."""
    owner = _owners(model)
    params = [p for group in opt.param_groups for p in group["params"]]
    return {i: owner[id(p)] for i, p in enumerate(params) if id(p) in owner}


def whole_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """``opt.state_dict()`` with the whole state of every split weight (its tensors shaped like
    the weight gathered), or ``None``, as :func:`whole_model_state`. Collective, as it."""
    state = opt.state_dict()
    for i, m in _sharded(model, opt).items():
        own = state["state"].get(i, {})
        state["state"][i] = {
            k: m.gather_whole(v) if isinstance(v, torch.Tensor) and v.shape == m.weight.shape else v
            for k, v in own.items()
        }
    return state if _writer(model) else None


def own_optimizer_state(
    model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any]:
    """``state`` (an optimizer state dict) with every split weight's whole tensors cut to this
    rank's columns, for ``opt.load_state_dict``."""
    cut = dict(state, state=dict(state["state"]))
    for i, m in _sharded(model, opt).items():
        whole = (m.out_features, m.in_features)
        cut["state"][i] = {
            k: m.own_columns(v) if isinstance(v, torch.Tensor) and tuple(v.shape) == whole else v
            for k, v in cut["state"].get(i, {}).items()
        }
    return cut

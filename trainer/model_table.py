"""The models the trainer builds, in one table: how each is built, what fields it needs, how
it is scored.

Config key ``model`` names an entry of :data:`MODELS`; everything that depends on the model
reads the entry, never the name: ``trainer.train.build_model`` builds it, ``trainer.preflight``
checks the fields (:attr:`Model.check_fields`), the depth (:attr:`Model.default_depth`) and
the parameters (:func:`parameter_count`, from the model built on the meta device), and
``trainer.metrics`` scores it by its :attr:`Model.task`. A new model is a builder and one
:func:`register` call; a name not in the table is refused, naming the ones that are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from trainer.models import CosmoFlow, LayerFactory, UNet3D

__all__ = ["MODELS", "TASKS", "Builder", "Model", "model_named", "parameter_count", "register"]

TASKS = ("vector", "voxel")  # trainer.metrics: a vector per sample, or a volume

Field = tuple[str, Sequence[int], Sequence[int]]
"""``(name, per-sample shape, spatial axes)`` of a field."""


class Builder(Protocol):
    """Builds the model for an input of ``in_channels`` x ``spatial`` and a target of
    ``out_channels`` (channels first), ``width`` filters at the first level and ``depth``
    poolings, its spatial layers from ``layers`` (``None``: ``TorchLayers``)."""

    def __call__(
        self, in_channels: int, out_channels: int, spatial: tuple[int, ...], *,
        width: int, depth: int, dropout: float, layers: LayerFactory | None,
    ) -> nn.Module: ...  # fmt: skip


@dataclass(frozen=True)
class Model:
    """One model the trainer can build.

    Args:
        name: config key ``model``'s value.
        build: the :class:`Builder`.
        task: how it is scored, one of :data:`TASKS`.
        check_fields: raises ``ValueError`` naming the field, for input and target fields
            (``Field``) it cannot train on; the input is ``(C, D, H, W)`` with spatial axes
            ``(1, 2, 3)`` already (``trainer.preflight.check_fields``).
        default_depth: the poolings for a cube of this side when ``conv_blocks`` is 0.
        dropout: whether it has dropout layers (config key ``dropout`` is refused otherwise).
            Default: ``False``.
    """

    name: str
    build: Builder
    task: str
    check_fields: Callable[[Field, Field], None]
    default_depth: Callable[[int], int]
    dropout: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"model {self.name!r}: task {self.task!r} is not one of {TASKS}")


MODELS: dict[str, Model] = {}
"""Every model by name, in the order registered."""


def register(model: Model) -> Model:
    """Add ``model`` to :data:`MODELS`.

    Raises:
        ValueError: a name already registered.
    """
    if model.name in MODELS:
        raise ValueError(f"model {model.name!r} is registered already")
    MODELS[model.name] = model
    return model


def model_named(name: object) -> Model:
    """The model ``name``.

    Raises:
        ValueError: naming the known models, for a name not in :data:`MODELS`.
    """
    model = MODELS.get(name) if isinstance(name, str) else None
    if model is None:
        raise ValueError(f"unknown model {name!r} (one of: {', '.join(MODELS)})")
    return model


def parameter_count(
    model: Model, in_channels: int, out_channels: int, spatial: tuple[int, ...], width: int,
    depth: int,
) -> int:  # fmt: skip
    """Trainable parameters of ``model`` as built for these arguments, from the model built on
    the meta device (shapes only, nothing allocated).

    A width whose tensors torch cannot describe (sizes past 64 bits, e.g. ``10**11``) is
    counted exactly from the count's form in the width: every parameter tensor is a product of
    at most two channel counts proportional to it, so the count is a quadratic, read off the
    models of widths 1, 2 and 3 and checked at width 4.

    Raises:
        ValueError: a model whose count is no quadratic in the width, at a width torch
            cannot describe.
    """

    def count(w: int) -> int:
        with torch.device("meta"):
            built = model.build(
                in_channels, out_channels, spatial, width=w, depth=depth, dropout=0.0, layers=None
            )
        return sum(p.numel() for p in built.parameters() if p.requires_grad)

    try:
        return count(width)
    except (RuntimeError, TypeError, OverflowError):  # "overflow": past torch's int64 sizes
        pass
    p1, p2, p3, p4 = (count(w) for w in (1, 2, 3, 4))
    a2 = p1 - 2 * p2 + p3  # twice the quadratic's leading coefficient
    b = p2 - p1 - 3 * a2 // 2
    c = p1 - a2 // 2 - b
    if a2 % 2 or 8 * a2 + 4 * b + c != p4:
        raise ValueError(
            f"model {model.name!r}: its parameters are no quadratic in the width, and width "
            f"{width} is too large to build even on the meta device"
        )
    return a2 // 2 * width**2 + b * width + c


# -- the models ---------------------------------------------------------------------------------
def _cosmoflow(
    in_channels: int, out_channels: int, spatial: tuple[int, ...], *, width: int, depth: int,
    dropout: float, layers: LayerFactory | None,
) -> nn.Module:  # fmt: skip
    return CosmoFlow(
        in_channels, out_channels, input_size=spatial[0], conv_size=width, n_conv=depth,
        dropout=dropout, layers=layers,
    )  # fmt: skip


def _cosmoflow_fields(inputs: Field, targets: Field) -> None:
    name, shape, _ = inputs
    if len(set(shape[1:])) != 1:
        raise ValueError(f"input field {name!r}: cosmoflow needs a cube, got {shape[1:]}")
    tname, tshape, _ = targets
    if len(tshape) != 1:
        raise ValueError(
            f"target field {tname!r}: cosmoflow predicts a vector per sample, got shape "
            f"{tuple(tshape)}"
        )


def _unet3d(
    in_channels: int, out_channels: int, spatial: tuple[int, ...], *, width: int, depth: int,
    dropout: float, layers: LayerFactory | None,
) -> nn.Module:  # fmt: skip
    return UNet3D(
        in_channels, out_channels, base=width, depth=depth, residual=in_channels == out_channels,
        layers=layers,
    )  # fmt: skip


def _unet3d_fields(inputs: Field, targets: Field) -> None:
    shape = tuple(inputs[1])
    tname, tshape, taxes = targets
    if len(tshape) != 4 or tuple(tshape[1:]) != shape[1:] or tuple(taxes) != (1, 2, 3):
        raise ValueError(
            f"target field {tname!r}: unet3d predicts a volume of the input's spatial shape "
            f"{shape[1:]} with channels first, got shape {tuple(tshape)}"
        )


def _log2(side: int) -> int:
    return side.bit_length() - 1 if side > 0 else 0


register(
    Model("cosmoflow", _cosmoflow, "vector", _cosmoflow_fields, lambda s: min(5, _log2(s)), True)
)
register(Model("unet3d", _unet3d, "voxel", _unet3d_fields, lambda s: max(1, min(3, _log2(s) - 2))))

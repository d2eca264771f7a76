"""The model table: a model added by registration alone trains, an unknown name is refused
everywhere, and the preflight parameter counts are those of the models the trainer builds."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from trainer.config import ConfigError, TrainConfig
from trainer.cosmology import write_split
from trainer.model_table import MODELS, Model, model_named, register
from trainer.preflight import check_fields, check_run, model_depth, model_parameters
from trainer.start import Run
from trainer.train import build_model, train

KNOWN = r"\(one of: cosmoflow, unet3d\)$"


def _run(model: str, cin: int, cout: int, side: int, depth: int) -> Run:
    target = (cout,) if model == "cosmoflow" else (cout, side, side, side)
    return Run(
        device=torch.device("cpu"), backend="gloo", grid=None, depth=depth,
        inputs=("x", (cin, side, side, side), (1, 2, 3)),
        targets=("y", target, (1, 2, 3) if len(target) == 4 else ()),
        samples=8, total_steps=1,
    )  # fmt: skip


@pytest.mark.parametrize("model", ["cosmoflow", "unet3d"])
@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("cin, cout", [(4, 4), (2, 3)])
def test_preflight_counts_the_parameters_of_the_model_the_trainer_builds(model, width, cin, cout):
    side, depth = 16, 2
    cfg = TrainConfig(
        data="d", model=model, width=width, dropout=0.1 if model == "cosmoflow" else 0
    )
    built = build_model(cfg, _run(model, cin, cout, side, depth))
    assert next(built.parameters()).device.type == "cpu"
    real = sum(p.numel() for p in built.parameters())
    assert model_parameters(model, cin, cout, side, width, depth) == real


@pytest.mark.parametrize(
    ("model", "width", "count"),
    [
        ("cosmoflow", 10**11, 45900000013121100000008644),  # torch cannot describe these
        ("unet3d", 10**11, 54660000000025100000000004),
        (
            "cosmoflow",
            2**100,
            7375845623148765364737606004012266048483457949462803038313914820,
        ),
    ],
)
def test_a_width_torch_cannot_describe_is_counted_exactly(model, width, count):
    """The counts of the architectures written out by hand (the count before the table)."""
    assert model_parameters(model, 4, 4, 128, width, 5 if model == "cosmoflow" else 3) == count


def test_an_unknown_model_is_refused_not_built_as_cosmoflow():
    # A config that bypasses TrainConfig's check (a name missed in the table) used to be built
    # as CosmoFlow and scored as a U-Net.
    cfg = types.SimpleNamespace(model="resnet3d", width=2, dropout=0.0)
    with pytest.raises(ValueError, match=r"^unknown model 'resnet3d' " + KNOWN):
        build_model(cfg, _run("cosmoflow", 4, 4, 16, 2))
    x, y = ("x", (4, 16, 16, 16), (1, 2, 3)), ("y", (4,), ())
    for check in (
        lambda: check_fields("resnet3d", x, y),
        lambda: model_depth("resnet3d", 16, 0),
        lambda: model_parameters("resnet3d", 4, 4, 16, 2, 2),
    ):
        with pytest.raises(ValueError, match=r"^unknown model 'resnet3d' " + KNOWN):
            check()
    with pytest.raises(ConfigError, match=r"config key 'model': 'resnet3d' is not one of "):
        TrainConfig(data="d", model="resnet3d")
    with pytest.raises(ValueError, match=r"^model 'unet3d' is registered already$"):
        register(model_named("unet3d"))


class _Pointwise(nn.Module):
    """A voxel-wise model with no pooling: two 1x1x1 convolutions."""

    def __init__(self, cin: int, cout: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv3d(cin, width, 1), nn.ReLU(), nn.Conv3d(width, cout, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


def _pointwise_fields(inputs, targets) -> None:
    if tuple(targets[1]) != tuple(inputs[1]):
        raise ValueError(f"target field {targets[0]!r}: pointwise predicts the input's shape")


@pytest.fixture
def pointwise():
    model = register(
        Model(
            "pointwise",
            lambda cin, cout, spatial, *, width, depth, dropout, layers: _Pointwise(
                cin, cout, width
            ),
            "voxel",
            _pointwise_fields,
            lambda side: 0,
        )
    )
    yield model
    MODELS.pop("pointwise")


def test_a_registered_model_is_checked_counted_built_trained_and_scored(tmp_path, pointwise):
    write_split(tmp_path, 16, 8, 8, seed=0, noise=0.3)
    x, clean = ("noisy", (4, 8, 8, 8), (1, 2, 3)), ("x", (4, 8, 8, 8), (1, 2, 3))
    assert check_run("pointwise", x, clean, (1, 1, 1), 0, 1) == 0
    with pytest.raises(ValueError, match=r"^target field 'y': pointwise predicts"):
        check_fields("pointwise", x, ("y", (4,), ()))
    assert model_parameters("pointwise", 4, 4, 8, 5, 0) == (4 * 5 + 5) + (5 * 4 + 4)
    cfg = TrainConfig(
        data=str(tmp_path), model="pointwise", input_field="noisy", target_field="x", width=5,
        steps=4, global_batch=4, lr=1e-3, log_file=str(tmp_path / "log.jsonl"),
    )  # fmt: skip
    result = train(cfg)
    assert len(result["losses"]) == 4
    # scored as a voxel task: the identity baseline is there (the input predicts the target)
    assert result["identity_mse"] == pytest.approx(0.09, rel=0.2)

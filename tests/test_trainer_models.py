"""CosmoFlow and UNet3D: shapes, parameter counts, and that every spatial layer comes from the
layer factory (so a distributed factory can replace them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.models import CosmoFlow, TorchLayers, UNet3D, count_parameters

SPATIAL = (nn.Conv3d, nn.MaxPool3d, nn.BatchNorm3d, nn.ConvTranspose3d, nn.Flatten)


class RecordingLayers(TorchLayers):
    """The torch factory, remembering every module it made."""

    def __init__(self) -> None:
        self.made: list[nn.Module] = []

    def _keep(self, m: nn.Module) -> nn.Module:
        self.made.append(m)
        return m

    def conv3d(self, cin, cout, k, stride=1):
        return self._keep(super().conv3d(cin, cout, k, stride))

    def maxpool3d(self, k):
        return self._keep(super().maxpool3d(k))

    def batchnorm3d(self, c):
        return self._keep(super().batchnorm3d(c))

    def conv_transpose3d(self, cin, cout, k):
        return self._keep(super().conv_transpose3d(cin, cout, k))

    def flatten_linear(self, channels, whole, out):
        return self._keep(super().flatten_linear(channels, whole, out))


def conv(cin, cout, k):
    return cin * cout * k**3 + cout


def cosmoflow_params(cin, n_out, size, c, n_conv, fc1, fc2):
    total, ch = 0, cin
    for i in range(n_conv):
        total += conv(ch, c * 2**i, 3)
        ch = c * 2**i
    flat = ch * (size // 2**n_conv) ** 3
    return total + (flat * fc1 + fc1) + (fc1 * fc2 + fc2) + (fc2 * n_out + n_out)


def test_cosmoflow_reference_size_has_the_expected_parameters():
    model = CosmoFlow(4, 4, input_size=128, conv_size=32)
    assert count_parameters(model) == cosmoflow_params(4, 4, 128, 32, 5, 128, 64)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv3d)]
    assert [m.out_channels for m in convs] == [32, 64, 128, 256, 512]
    assert all(m.kernel_size == (3, 3, 3) and m.padding == (1, 1, 1) for m in convs)
    assert sum(isinstance(m, nn.MaxPool3d) for m in model.modules()) == 5
    assert sum(isinstance(m, nn.LeakyReLU) for m in model.modules()) == 7


@pytest.mark.parametrize("size", [32, 64])
def test_cosmoflow_forward(size):
    torch.manual_seed(0)
    model = CosmoFlow(4, 3, input_size=size, conv_size=4, dropout=0.2)
    assert count_parameters(model) == cosmoflow_params(4, 3, size, 4, 5, 128, 64)
    out = model(torch.randn(2, 4, size, size, size))
    assert out.shape == (2, 3) and out.abs().max() <= 1.2
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("size", [32, 64])
def test_unet_forward(size):
    torch.manual_seed(0)
    model = UNet3D(4, 2, base=4, depth=3)
    x = torch.randn(1, 4, size, size, size, requires_grad=True)
    out = model(x)
    assert out.shape == (1, 2, size, size, size)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_unet_parameters_and_skips():
    b, d = 4, 3
    model = UNet3D(4, 2, base=b, depth=d)
    w = [b * 2**i for i in range(d + 1)]

    def double(cin, cout):  # two (conv, BatchNorm with weight and bias)
        return conv(cin, cout, 3) + 2 * cout + conv(cout, cout, 3) + 2 * cout

    expected = sum(double(cin, cout) for cin, cout in zip([4, *w[:-1]], w, strict=True))
    for c in reversed(w[:-1]):
        expected += (2 * c * c * 8 + c) + double(2 * c, c)  # up-convolution, then merge
    expected += conv(w[0], 2, 1)
    assert count_parameters(model) == expected
    with pytest.raises(ValueError, match="divisible"):
        model(torch.randn(1, 4, 12, 16, 16))


@pytest.mark.parametrize(
    "build",
    [
        lambda f: CosmoFlow(4, 4, input_size=32, conv_size=4, layers=f),
        lambda f: UNet3D(4, 1, base=4, depth=2, layers=f),
    ],
)
def test_every_spatial_layer_comes_from_the_factory(build):
    factory = RecordingLayers()
    model = build(factory)
    spatial = [m for m in model.modules() if isinstance(m, SPATIAL)]
    assert spatial and all(any(m is k for k in factory.made) for m in spatial)


def test_cosmoflow_rejects_bad_geometry():
    with pytest.raises(ValueError, match="divisible"):
        CosmoFlow(input_size=48)
    with pytest.raises(ValueError, match="odd"):
        CosmoFlow(input_size=32, kernel_size=2)

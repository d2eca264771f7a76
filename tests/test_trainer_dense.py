"""The first dense layer's pure parts: which columns of the whole weight a block holds, and the
single-process layer keeping ``nn.Linear``'s state (checkpoints of either load in the other).
Its split form under real ranks: ``tests/test_trainer_dist_models.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from datastore.maths.partition import Grid, block_bounds
from trainer.dense import FlattenLinear, block_columns
from trainer.models import CosmoFlow


@pytest.mark.parametrize(
    ("whole", "parts"), [((4, 4, 4), (2, 1, 1)), ((4, 6, 2), (2, 3, 1)), ((5, 3, 3), (2, 1, 2))]
)
def test_a_block_holds_the_flatten_features_of_its_voxels_in_its_own_flatten_order(whole, parts):
    channels = 3
    volume = torch.arange(channels * torch.Size(whole).numel()).reshape(channels, *whole)
    grid = Grid(whole, parts)
    seen = []
    for r in range(grid.nblocks):
        block = block_bounds(grid, r)
        cols = block_columns(channels, whole, block)
        assert torch.equal(cols, volume[(slice(None), *block)].flatten())
        seen.append(cols)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(volume.numel()))


def test_the_single_process_layer_is_nn_linear_of_the_flattened_input():
    torch.manual_seed(3)
    layer = FlattenLinear(2, (3, 3, 3), 5)
    torch.manual_seed(3)
    plain = nn.Linear(2 * 27, 5)
    x = torch.randn(4, 2, 3, 3, 3)
    assert torch.equal(layer(x), plain(x.flatten(1)))
    assert layer.state_dict().keys() == plain.state_dict().keys()


def test_cosmoflow_keeps_its_state_dict_keys():
    """``head.0`` is still the first dense layer: checkpoints written before keep loading."""
    model = CosmoFlow(4, 4, input_size=32, conv_size=2, n_conv=2)
    state = model.state_dict()
    assert state["head.0.weight"].shape == (128, 4 * 8**3)
    assert not any(k.startswith("flatten") for k in state)

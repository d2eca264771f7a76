"""The traps a new PyTorch user meets, each once silent (issue 11): one process."""

from __future__ import annotations

import itertools

import h5py
import numpy as np
import pytest
import torch

import datastore.ring
from datastore import DataStoreLoader
from datastore.errors import InsufficientMemory
from datastore.order import Schedule
from datastore.partition import Grid, extract_block

N, C, D = 22, 2, 8


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("traps") / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((N, C, D, D, D), dtype=np.float32)
        f["y"] = rng.standard_normal((N, 3), dtype=np.float32)
        f["idx"] = np.arange(N, dtype=np.int64)
    with h5py.File(path, "r") as f:
        return str(path), f["x"][...], f["y"][...]


def test_1_stopping_after_len_batches_still_moves_on_to_the_next_epoch(h5):
    path, _, _ = h5
    loader = DataStoreLoader(path, batch_size=4, seed=2)
    sched = Schedule(N, 4, seed=2)
    for epoch in range(3):  # islice(loader, len(loader)), as Lightning consumes it
        got = [b["idx"].tolist() for b in itertools.islice(loader, len(loader))]
        assert got == sched.order(epoch).reshape(-1, 4).tolist()
        assert loader.state_dict()["epoch"] == epoch + 1 and loader.state_dict()["step"] == 0
    for i, b in enumerate(loader):  # break at the last batch
        if i == len(loader) - 1:
            assert b["idx"].tolist() == sched.order(3)[-4:].tolist()
            break
    assert loader.epoch == 4


def test_3_kept_batches_are_never_overwritten_and_dropped_ones_are_reused(h5):
    path, _, y = h5
    loader = DataStoreLoader(path, batch_size=1, seed=4, prefetch=2)
    ys = [b["y"] for b in loader]  # kept: every batch its own buffer
    order = Schedule(N, 1, seed=4).order(0)
    assert all(np.array_equal(t.numpy()[0], y[i]) for t, i in zip(ys, order, strict=True))
    pointers = set()
    for b in loader:  # dropped at once: the same few buffers come back
        pointers.add(b["x"].untyped_storage().data_ptr())
    assert len(pointers) <= loader.options.prefetch + 3


def test_4_padding_is_marked_in_valid(h5):
    path, _, _ = h5
    loader = DataStoreLoader(path, batch_size=4, seed=1, drop_last=False)
    masks = [b["valid"] for b in loader]
    assert all(m.dtype == torch.bool and m.shape == (4,) for m in masks)
    assert int(sum(m.sum() for m in masks)) == N
    assert masks[-1].tolist() == [True, True, False, False]  # 22 = 5 * 4 + 2
    assert all(m.all() for m in masks[:-1])


def test_4_a_field_named_valid_with_padding_is_refused(tmp_path):
    path = tmp_path / "v.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((5, 2), np.float32)
        f["valid"] = np.ones(5, bool)
    with pytest.raises(ValueError, match="valid"):
        DataStoreLoader(str(path), batch_size=2, drop_last=False)
    DataStoreLoader(str(path), batch_size=2, drop_last=False, fields=["x"]).close()


@pytest.mark.parametrize("budget", ["64G", "512M", "1.5G", 1 << 30])
def test_7_memory_budget_as_on_the_cli(h5, budget):
    loader = DataStoreLoader(h5[0], batch_size=2, memory_budget=budget)
    assert loader.options.memory_budget in (64 << 30, 512 << 20, int(1.5 * (1 << 30)), 1 << 30)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"spatial": {"halo": (1, 1, 1)}}, "parts"),
        ({"spatial": {"parts": (2, 1)}}, "axes"),
        ({"spatial": {"parts": (2, 1, 1), "halo": (1, 1)}}, "halo"),
    ],
)
def test_7_malformed_arguments_are_value_errors_naming_them(h5, kw, match):
    with pytest.raises(ValueError, match=match):
        DataStoreLoader(h5[0], batch_size=2, rank=0, world=2, **kw)


def test_7_a_dataset_larger_than_memory_is_refused_before_reading(h5, monkeypatch):
    monkeypatch.setenv("DATASTORE_MEMORY_AVAILABLE", "50K")  # the dataset is 90 KiB
    with pytest.raises(InsufficientMemory, match="memory_budget") as e:
        DataStoreLoader(h5[0], batch_size=2)
    assert isinstance(e.value, MemoryError)
    with DataStoreLoader(h5[0], batch_size=2, memory_budget="40K", preload=False) as ok:
        assert ok.counters.misses == 0  # nothing read yet


@pytest.mark.skipif(torch.cuda.is_available(), reason="the note is for machines without CUDA")
def test_8_the_pin_memory_note_comes_once(h5, monkeypatch):
    monkeypatch.setattr(datastore.ring, "_pin_noted", False)
    with pytest.warns(UserWarning, match="pin_memory") as caught:
        for _ in range(2):
            loader = DataStoreLoader(h5[0], batch_size=2, pin_memory=True, prefetch=4)
            for _ in range(2):
                list(loader)
    assert sum("pin_memory" in str(w.message) for w in caught) == 1


@pytest.mark.filterwarnings("ignore:datastore. 2 ranks")
def test_12_editing_a_batch_in_place_never_reaches_the_next(h5):
    path, x, _ = h5
    spatial = {"parts": (2, 1, 1), "halo": 1}
    grid = Grid((D, D, D), (2, 1, 1), (1, 1, 1))
    edited = DataStoreLoader(path, batch_size=2, seed=3, spatial=spatial, rank=0, world=2)
    order = Schedule(N, 2, seed=3)
    for epoch in range(2):
        for step, b in enumerate(edited):
            ids = order.order(epoch)[step * 2 : step * 2 + 2]
            want = np.stack([extract_block(x[i], grid, 0, (1, 2, 3)) for i in ids])
            assert np.array_equal(b["x"].numpy(), want)  # zero halo border included
            b["x"].mul_(0).add_(7)


def test_unknown_arguments_are_type_errors_in_every_mode(h5, tmp_path):
    with pytest.raises(TypeError, match="shufle"):
        DataStoreLoader(h5[0], batch_size=2, shufle=True)
    with pytest.raises(TypeError, match="shufle"):
        DataStoreLoader(h5[0], batch_size=2, address=str(tmp_path / "s.sock"), shufle=True)

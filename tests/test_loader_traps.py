"""The traps a new PyTorch user meets, each once silent (issue 11): one process, real HDF5 files.

Traps 1, 3, 4, 7, 8, 12 and unknown keywords; the ones that need ranks are in
``test_loader_traps_mpi.py`` and ``test_loader_stops_mpi.py``.
"""

from __future__ import annotations

import itertools
import warnings

import h5py
import numpy as np
import pytest
import torch

import datastore.loader
import datastore.store.ring
from datastore import DataStoreLoader
from datastore.errors import DataStoreError, InsufficientMemory
from datastore.maths.order import Schedule
from datastore.maths.partition import Grid, extract_block
from datastore.sources.options import ServiceOptions, StoreOptions

N, C, D = 22, 2, 8
NO_COMM = "ignore:datastore. 2 ranks"  # rank/world given without MPI or torch.distributed


def write(path, n: int, seed: int, valid: bool = False, size: int = D) -> str:
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((n, C, size, size, size), dtype=np.float32)
        f["y"] = rng.standard_normal((n, 3), dtype=np.float32)
        f["idx"] = np.arange(n, dtype=np.int64)
        if valid:
            f["valid"] = rng.integers(0, 2, n).astype(bool)
    return str(path)


def contents(path: str) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][...] for k in f}


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    """N = 22 samples: ``x`` (C, D, D, D) float32, ``y`` (3,), ``idx``; returns (path, x, y)."""
    path = write(tmp_path_factory.mktemp("traps") / "d.h5", N, 7)
    data = contents(path)
    return path, data["x"], data["y"]


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """Every sample of ``epoch`` once, in the loader's order (batches of 1 drop nothing)."""
    return Schedule(n, 1, seed=seed).order(epoch)


# -- 1. skipped epochs ------------------------------------------------------------------------
def test_1_islice_len_batches_for_three_epochs_sees_epochs_0_1_2(h5):
    path, x, _ = h5
    loader = DataStoreLoader(path, batch_size=4, seed=2)
    sched = Schedule(N, 4, seed=2)
    assert len(loader) == N // 4
    for epoch in range(3):  # islice(loader, len(loader)), as Lightning consumes it; no set_epoch
        got = []
        for i, b in enumerate(itertools.islice(loader, len(loader))):
            got.append(b["idx"].tolist())
            assert np.array_equal(b["x"].numpy(), x[b["idx"].numpy()])
            if i < len(loader) - 1:
                assert loader.state_dict()["epoch"] == epoch
                assert loader.state_dict()["step"] == i + 1
            else:  # right after the last batch, before anyone asks for one more
                saved = loader.state_dict()
                assert (saved["epoch"], saved["step"]) == (epoch + 1, 0)
                assert loader.epoch == epoch + 1
        assert got == sched.order(epoch).reshape(-1, 4).tolist()
    # a plain loop afterwards takes epoch 3, whole
    assert [b["idx"].tolist() for b in loader] == sched.order(3).reshape(-1, 4).tolist()
    assert (loader.epoch, loader.state_dict()["step"]) == (4, 0)


def test_1_a_lightning_style_break_at_the_last_batch_moves_on(h5):
    path, _, _ = h5
    loader = DataStoreLoader(path, batch_size=4, seed=2)
    sched = Schedule(N, 4, seed=2)
    for epoch in range(2):
        got = []
        for i, b in enumerate(loader):
            got.append(b["idx"].tolist())
            if i == len(loader) - 1:  # Lightning's limit: len(loader) batches, then break
                break
        assert got == sched.order(epoch).reshape(-1, 4).tolist()
        assert loader.epoch == epoch + 1 and loader.state_dict()["step"] == 0
    # resuming from the state taken right after the last batch starts the next epoch
    saved = loader.state_dict()
    again = DataStoreLoader(path, batch_size=4, seed=2)
    again.load_state_dict(saved)
    assert [b["idx"].tolist() for b in again] == sched.order(2).reshape(-1, 4).tolist()


# -- 3. aliased buffers -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def h5_20(tmp_path_factory):
    """20 samples: an epoch of 20 steps with batch_size=1."""
    path = write(tmp_path_factory.mktemp("traps20") / "d20.h5", 20, 11)
    return path, contents(path)


def test_3_kept_batches_keep_their_data(h5_20):
    path, data = h5_20
    loader = DataStoreLoader(path, batch_size=1, seed=4, prefetch=2)
    ys = [b["y"] for b in loader]  # kept: each its own buffer
    xs = [b["x"].numpy() for b in loader]  # numpy views keep their buffer too
    firsts = [b["idx"][0] for b in loader]  # so do views of a part of a tensor
    list(loader)  # one more epoch into the buffers that are free
    orders = [permutation(20, 4, e) for e in range(3)]
    assert len(ys) == len(xs) == len(firsts) == 20
    for step in range(20):
        assert np.array_equal(ys[step].numpy(), data["y"][orders[0][step : step + 1]])
        assert np.array_equal(xs[step], data["x"][orders[1][step : step + 1]])
        assert int(firsts[step]) == orders[2][step]


def test_3_dropped_batches_reuse_a_few_buffers(h5_20):
    path, data = h5_20
    prefetch = 2
    loader = DataStoreLoader(path, batch_size=1, seed=4, prefetch=prefetch)
    order = permutation(20, 4, 0)
    pointers: dict[str, set[int]] = {"x": set(), "y": set(), "idx": set()}
    steps = 0
    for step, b in enumerate(loader):  # a careful consumer: uses each batch, keeps none
        assert b["idx"].tolist() == [order[step]]
        assert np.array_equal(b["x"].numpy(), data["x"][order[step : step + 1]])
        for name, seen in pointers.items():
            seen.add(b[name].untyped_storage().data_ptr())
        steps += 1
    assert steps == 20
    for name, seen in pointers.items():
        assert len(seen) <= prefetch + 3, (name, len(seen))
    assert loader.ring.made <= prefetch + 3


# -- 4. padding -------------------------------------------------------------------------------
def test_4_valid_marks_the_real_samples_of_a_padded_epoch(h5):
    path, x, _ = h5
    loader = DataStoreLoader(path, batch_size=4, seed=1, drop_last=False)
    assert len(loader) == 6  # 22 = 5 * 4 + 2
    for epoch in range(2):
        batches = list(loader)
        perm = permutation(N, 1, epoch)
        padded = np.concatenate([perm, perm[:2]])  # the epoch's first samples pad the tail
        real = []
        for step, b in enumerate(batches):
            m = b["valid"]
            assert m.dtype == torch.bool and m.shape == (4,)
            ids = b["idx"].numpy()
            assert ids.tolist() == padded[step * 4 : step * 4 + 4].tolist()
            assert np.array_equal(b["x"].numpy(), x[ids])
            expect = [step * 4 + j < N for j in range(4)]
            assert m.tolist() == expect
            real += ids[m.numpy()].tolist()
        assert real == perm.tolist()  # every sample once, as real
        assert int(sum(int(b["valid"].sum()) for b in batches)) == N


@pytest.mark.filterwarnings(NO_COMM)
def test_4_valid_per_rank_sums_to_the_dataset(h5):
    """Global batch 4 over 2 ranks: the last step's real samples are all on rank 0."""
    path, _, _ = h5
    masks = []
    for rank in (0, 1):
        loader = DataStoreLoader(
            path, global_batch_size=4, seed=1, drop_last=False, rank=rank, world=2
        )
        got = [b["valid"] for b in loader]
        assert all(m.dtype == torch.bool and m.shape == (2,) for m in got)
        masks.append([m.tolist() for m in got])
    assert masks[0][-1] == [True, True] and masks[1][-1] == [False, False]
    assert sum(sum(m) for r in masks for m in r) == N


@pytest.mark.filterwarnings(NO_COMM)
@pytest.mark.parametrize("drop_last", [False, True])
def test_4_len_of_the_sampler_counts_samples_as_distributed_samplers_does(h5, drop_last):
    """Scripts ported from ``DistributedSampler`` divide summed losses by ``len(sampler)``, the
    samples a rank gets per epoch. ``loader.sampler`` was the loader, whose ``len`` is the
    batches: 3 for 12 samples (a mean 4x too large). Its ``set_epoch`` is still ours."""
    path, _, _ = h5
    loader = DataStoreLoader(path, batch_size=4, seed=1, drop_last=drop_last, rank=1, world=2)
    sampler = loader.sampler
    per_rank = [b["idx"].numel() for b in loader]  # 22 = 2 * (2 * 4) + 6
    assert len(sampler) == sum(per_rank) == (12 if not drop_last else 8)
    assert len(loader) == (3 if not drop_last else 2)
    torch_sampler = torch.utils.data.DistributedSampler(range(N), 2, 1, drop_last=drop_last)
    assert len(sampler) - len(torch_sampler) == (1 if not drop_last else -3)  # ours: whole batches
    sampler.set_epoch(5)
    assert (loader.epoch, sampler.epoch) == (5, 5)
    want = Schedule(N, 8, seed=1, tail="drop" if drop_last else "pad").order(5).reshape(-1, 8)
    assert [b["idx"].tolist() for b in loader] == want[:, 4:].tolist()


@pytest.mark.filterwarnings(NO_COMM)
@pytest.mark.parametrize("drop_last", [False, True])
def test_4_len_of_the_dataset_counts_the_datasets_samples_as_a_dataloaders(h5, drop_last):
    """``test_loss /= len(test_loader.dataset)`` (PyTorch's MNIST example): ``loader.dataset``
    was the state's record of the data, a dict of 2 keys, so the mean came out 11 times too
    large for 22 samples. Its ``len`` is now the samples in the dataset, a ``DataLoader``'s."""
    path, _, _ = h5
    loader = DataStoreLoader(path, batch_size=4, seed=1, drop_last=drop_last, rank=1, world=2)
    torch_loader = torch.utils.data.DataLoader(range(N), batch_size=4, drop_last=drop_last)
    assert len(loader.dataset) == len(torch_loader.dataset) == N
    assert set(loader.state_dict()["dataset"]) == {"location", "identity"}


def test_4_no_padding_still_has_an_all_true_valid(tmp_path):
    path = write(tmp_path / "e.h5", 8, 3)
    loader = DataStoreLoader(path, batch_size=4, drop_last=False)
    assert [b["valid"].tolist() for b in loader] == [[True] * 4] * 2
    assert "valid" not in next(iter(DataStoreLoader(path, batch_size=4)))


def test_4_a_field_named_valid_with_padding_is_refused(tmp_path):
    path = write(tmp_path / "v.h5", 6, 2, valid=True)
    with pytest.raises(ValueError, match="valid"):
        DataStoreLoader(path, batch_size=4, drop_last=False)
    with DataStoreLoader(path, batch_size=4, drop_last=False, fields=["x", "idx"]) as ok:
        assert [b["valid"].tolist() for b in ok] == [[True] * 4, [True, True, False, False]]
    with DataStoreLoader(path, batch_size=3, seed=5) as kept:  # drop_last: "valid" is data
        want = contents(path)["valid"]
        for b in kept:
            assert np.array_equal(b["valid"].numpy(), want[b["idx"].numpy()])


# -- 7. arguments and memory ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("budget", "nbytes"), [("64G", 64 << 30), ("512M", 512 << 20), (1 << 30, 1 << 30)]
)
def test_7_memory_budget_as_on_the_cli(h5, budget, nbytes):
    with DataStoreLoader(h5[0], batch_size=2, store=StoreOptions(memory_budget=budget)) as loader:
        assert loader.options.store.memory_budget == nbytes
        assert len(list(loader)) == N // 2


@pytest.mark.filterwarnings(NO_COMM)
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"spatial": {"halo": (1, 1, 1)}}, "parts"),
        ({"spatial": {"parts": (2, 1)}}, "axes"),
        ({"spatial": {"parts": (2, 1, 1), "halo": (1, 1)}}, "halo"),
        ({"spatial": {"parts": (2, 1, 1), "hallo": 1}}, "hallo"),
    ],
)
def test_7_malformed_arguments_are_value_errors_naming_them(h5, kw, match):
    with pytest.raises(ValueError, match=match):
        DataStoreLoader(h5[0], batch_size=2, rank=0, world=2, **kw)


@pytest.mark.filterwarnings(NO_COMM)
def test_7_an_int_halo_means_every_axis(h5):
    path = h5[0]
    kw = {"batch_size": 2, "seed": 6, "rank": 0, "world": 2}
    one = DataStoreLoader(path, spatial={"parts": (2, 1, 1), "halo": 1}, **kw)
    three = DataStoreLoader(path, spatial={"parts": (2, 1, 1), "halo": (1, 1, 1)}, **kw)
    assert one.options.spatial == {"parts": (2, 1, 1), "halo": (1, 1, 1), "boundary": "zero"}
    assert one.grid.halo == (1, 1, 1)
    for a, b in zip(one, three, strict=True):
        assert a["x"].shape == (2, C, D // 2 + 2, D + 2, D + 2)
        assert np.array_equal(a["x"].numpy(), b["x"].numpy())


@pytest.fixture
def reads(monkeypatch):
    """Counts the samples the loader reads (the real reader, observed)."""
    count = {"n": 0}
    real_open = datastore.loader.open_dataset

    def observed(dataset, **kw):
        reader = real_open(dataset, **kw)
        real_read = reader.read

        def read(*args, **kw):
            count["n"] += 1
            return real_read(*args, **kw)

        reader.read = read
        return reader

    monkeypatch.setattr(datastore.loader, "open_dataset", observed)
    return count


def test_7_a_dataset_larger_than_memory_is_refused_before_reading(tmp_path, monkeypatch, reads):
    path = write(tmp_path / "big.h5", 20, 9, size=24)  # 20 x 2 x 24^3 float32: 4.2 MiB
    monkeypatch.setenv("DATASTORE_MEMORY_AVAILABLE", "1M")
    with pytest.raises(InsufficientMemory, match="memory_budget") as e:
        DataStoreLoader(path, batch_size=2)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, DataStoreError)
    assert reads["n"] == 0  # refused before any sample was read
    with DataStoreLoader(
        path, batch_size=2, seed=3, store=StoreOptions(memory_budget="1M")
    ) as ok:  # the way out
        assert reads["n"] > 0  # (the observer sees reads: preload read what fits)
        want = contents(path)
        for b in itertools.islice(ok, 3):
            assert np.array_equal(b["x"].numpy(), want["x"][b["idx"].numpy()])


# -- 8. the pin_memory note -------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the note is for machines without CUDA")
def test_8_the_pin_memory_note_comes_once_per_process(h5, monkeypatch):
    path, x, _ = h5
    monkeypatch.setattr(datastore.store.ring, "_pin_noted", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # not Python's once-per-place filter: the loader's own
        first = DataStoreLoader(path, batch_size=2, pin_memory=True, prefetch=4)
        for _ in range(2):
            for b in first:
                assert np.array_equal(b["x"].numpy(), x[b["idx"].numpy()])
        second = DataStoreLoader(path, batch_size=2, pin_memory=True, prefetch=4)
        list(second)
    notes = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(notes) == 1 and notes[0].category is UserWarning
    assert not first.ring.pin and not second.ring.pin


# -- 12. in-place edits -----------------------------------------------------------------------
@pytest.mark.filterwarnings(NO_COMM)
@pytest.mark.parametrize("rank", [0, 1])
def test_12_editing_a_batch_in_place_never_reaches_the_next(h5, rank):
    path, x, y = h5
    kw = {"batch_size": 2, "seed": 3, "spatial": {"parts": (2, 1, 1), "halo": 1}}
    edited = DataStoreLoader(path, rank=rank, world=2, **kw)
    clean = DataStoreLoader(path, rank=rank, world=2, **kw)
    grid = Grid((D, D, D), (2, 1, 1), (1, 1, 1))
    lo = 0 if rank == 0 else D // 2 - 1  # the box's first voxel along axis 0, in the volume
    inner = slice(1, D // 2 + 2) if rank == 0 else slice(0, D // 2 + 1)  # 5 voxels
    for _ in range(2):
        for a, b in zip(edited, clean, strict=True):
            ids = b["idx"].numpy()
            assert np.array_equal(a["x"].numpy(), b["x"].numpy())  # before the edit
            assert np.array_equal(a["y"].numpy(), b["y"].numpy())
            assert a["idx"].tolist() == ids.tolist()
            got = a["x"].numpy()
            want = np.stack([extract_block(x[i], grid, rank, (1, 2, 3)) for i in ids])
            assert np.array_equal(got, want)
            # the zero border, by hand: outside the volume on every side but the split face
            border = got.copy()
            assert np.array_equal(border[:, :, inner, 1:-1, 1:-1], x[ids][:, :, lo : lo + 5])
            border[:, :, inner, 1:-1, 1:-1] = 0
            assert not border.any()
            assert np.array_equal(a["y"].numpy(), y[ids])
            a["x"].mul_(0).add_(7)
            a["y"].mul_(0).add_(7)
            a["idx"].mul_(0)


def test_12_edited_batches_that_are_kept_stay_edited(h5):
    path, x, _ = h5
    loader = DataStoreLoader(path, batch_size=2, seed=8)
    kept = []
    for b in loader:
        assert np.array_equal(b["x"].numpy(), x[b["idx"].numpy()])
        b["x"].fill_(7)
        kept.append(b["x"])
    list(loader)  # another epoch: it must take other buffers than the ones kept
    assert all(bool((t == 7).all()) for t in kept)


# -- unknown keywords -------------------------------------------------------------------------
def test_unknown_arguments_are_type_errors_in_every_mode(h5, tmp_path):
    with pytest.raises(TypeError, match="shufle"):
        DataStoreLoader(h5[0], batch_size=2, shufle=True)
    with pytest.raises(TypeError, match="shufle"):  # before any connection is tried
        DataStoreLoader(
            h5[0], batch_size=2, shufle=True, service=ServiceOptions(str(tmp_path / "s.sock"))
        )
    with pytest.raises(TypeError, match="shufle"):
        DataStoreLoader(h5[0], batch_size=2, shufle=True, service=ServiceOptions("localhost:1"))

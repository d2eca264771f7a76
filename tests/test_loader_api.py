"""DataStoreLoader's hooks and the device stage: transform, collate, threads, device=."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from datastore import DataStoreLoader
from datastore.order import Schedule
from datastore.partition import Grid, extract_block

N, C, D = 12, 2, 8
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("api") / "train.h5"
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((N, C, D, D, D), dtype=np.float32)
        f["idx"] = np.arange(N, dtype=np.int64)
    with h5py.File(path, "r") as f:
        return str(path), f["x"][...]


@pytest.mark.filterwarnings("ignore:datastore. 2 ranks")
def test_transform_runs_on_every_batch_after_the_block_is_cut(h5):
    path, x = h5
    seen = []

    def transform(batch):
        seen.append(tuple(batch["x"].shape))
        return {"x": batch["x"] * 2, "idx": batch["idx"]}

    spatial = {"parts": (2, 1, 1), "halo": 1}
    loader = DataStoreLoader(
        path, batch_size=3, seed=4, spatial=spatial, transform=transform, rank=0, world=2
    )
    grid = Grid((D, D, D), (2, 1, 1), (1, 1, 1))
    for batch in loader:
        for pos, i in enumerate(batch["idx"].tolist()):
            assert np.array_equal(
                batch["x"][pos].numpy(), 2 * extract_block(x[i], grid, 0, (1, 2, 3))
            )
    assert seen == [(3, C, D // 2 + 2, D + 2, D + 2)] * len(loader)


def test_collate_shapes_what_iteration_yields(h5):
    path, x = h5
    loader = DataStoreLoader(path, batch_size=4, seed=2, collate=lambda b: (b["x"], b["idx"]))
    order = Schedule(N, 4, seed=2).order(0)
    for step, (xs, idx) in enumerate(loader):
        assert idx.tolist() == order[step * 4 : (step + 1) * 4].tolist()
        assert np.array_equal(xs.numpy(), x[idx.numpy()])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_number_of_gather_threads_gives_the_same_bytes(h5, threads):
    path, x = h5
    loader = DataStoreLoader(path, batch_size=5, seed=7, threads=threads, drop_last=False)
    for batch in loader:
        assert np.array_equal(batch["x"].numpy(), x[batch["idx"].numpy()])


def test_bad_device_and_threads_are_named(h5):
    with pytest.raises(ValueError, match="threads"):
        DataStoreLoader(h5[0], batch_size=2, threads=0)
    with pytest.raises(ValueError, match="device"):
        DataStoreLoader(h5[0], batch_size=2, device="nonsense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            DataStoreLoader(h5[0], batch_size=2, device="cuda")


@pytest.mark.cuda
@CUDA
def test_device_batches_arrive_on_the_gpu_and_equal_the_host_ones(h5):
    path, _ = h5
    host = [b["x"].clone() for b in DataStoreLoader(path, batch_size=3, seed=5)]
    loader = DataStoreLoader(
        path, batch_size=3, seed=5, device="cuda", pin_memory=True, prefetch=3,
        transform=lambda b: {**b, "x": b["x"].mul_(1.0)},
    )  # fmt: skip
    for _ in range(2):  # the second epoch reuses the pinned buffers
        got = []
        for batch in loader:
            assert batch["x"].is_cuda
            got.append(batch["x"].cpu())
            batch["x"].add_(1)  # edits on the consumer's stream never reach the next batch
        loader.set_epoch(0)
        assert all(torch.equal(a, b) for a, b in zip(host, got, strict=True))

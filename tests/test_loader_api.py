"""DataStoreLoader's hooks and the device stage: transform, collate, threads, device=."""

from __future__ import annotations

import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import datastore.loader
from datastore import DataStoreLoader
from datastore.maths.order import Schedule
from datastore.maths.partition import Grid, extract_block
from datastore.sources.options import ExchangeOptions, ServiceOptions, StoreOptions
from datastore.store.device import tensors_in

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


def test_a_spec_from_the_package_reads_as_its_path_does(h5, tmp_path):
    """``from datastore import DatasetSpec`` (as docs/loader.md shows it): a spec file and its
    ``DatasetSpec`` give the loader the path's exact batches."""
    from datastore import DatasetSpec

    spec = tmp_path / "train-spec.toml"
    spec.write_text(f'format = "hdf5"\npaths = "{h5[0]}"\n')
    runs = [h5[0], str(spec), DatasetSpec.load(spec)]
    got = [[b["x"] for b in DataStoreLoader(d, batch_size=4, seed=3)] for d in runs]
    for other in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[0], other, strict=True))


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


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_random_transform_draws_in_the_loops_order_as_dataloader_num_workers_0(h5, device):
    """A transform drawing from torch's generator (as torchvision's random transforms do) and a
    loop drawing too (dropout): one seed, one result, the draws interleaved batch by batch as
    in a plain loop. (Run in the prefetch thread, the transform drew ahead of the loop.)"""
    path, x = h5

    def noise(batch):
        return {**batch, "x": batch["x"] + torch.rand(batch["x"].shape)}

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        loader = DataStoreLoader(path, batch_size=3, seed=4, transform=noise, device=device)
        got = []
        for batch in loader:
            got.append(batch["x"].clone())
            torch.rand(5)  # the step's own draw, after the batch's
        loader.close()
        return got

    torch.manual_seed(0)
    want = []
    for step in range(N // 3):  # the same batches, the draws in a plain loop's order
        idx = Schedule(N, 3, seed=4).order(0)[step * 3 : (step + 1) * 3]
        want.append(noise({"x": torch.from_numpy(x[idx])})["x"])
        torch.rand(5)
    for got in (run(), run()):
        assert len(got) == len(want)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_collate_shapes_what_iteration_yields(h5):
    path, x = h5
    loader = DataStoreLoader(path, batch_size=4, seed=2, collate=lambda b: (b["x"], b["idx"]))
    order = Schedule(N, 4, seed=2).order(0)
    for step, (xs, idx) in enumerate(loader):
        assert idx.tolist() == order[step * 4 : (step + 1) * 4].tolist()
        assert np.array_equal(xs.numpy(), x[idx.numpy()])


@pytest.mark.parametrize("hook", ["transform", "collate"])
def test_a_batch_a_hook_fails_on_is_not_handed_out(h5, hook):
    """As with ``StatefulDataLoader`` (its ``collate_fn`` fails before the batch is yielded):
    the state after the error is at the failed batch, which a resume gives again. A failed
    ``collate`` counted its batch as handed out (step 3 after failing on the third)."""
    calls = []

    def fail_third(batch):
        calls.append(batch["idx"].tolist())
        if len(calls) == 3:
            raise ValueError("bad batch")
        return batch

    loader = DataStoreLoader(h5[0], batch_size=2, seed=4, **{hook: fail_third})
    with pytest.raises(ValueError, match="bad batch"):
        for _ in loader:
            pass
    assert loader.state_dict()["step"] == 2
    again = DataStoreLoader(h5[0], batch_size=2, seed=4)
    again.load_state_dict(loader.state_dict())
    assert next(iter(again))["idx"].tolist() == calls[2]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_any_number_of_gather_threads_gives_the_same_bytes(h5, threads):
    path, x = h5
    loader = DataStoreLoader(path, batch_size=5, seed=7, threads=threads, drop_last=False)
    for batch in loader:
        assert np.array_equal(batch["x"].numpy(), x[batch["idx"].numpy()])


def test_a_pass_left_open_at_exit_stops_its_prefetch_thread_first(h5):
    """``batches = iter(loader)``, a peek, and the script ends: the prefetch thread, still
    filling batches, is stopped by the loader's exit hook (``atexit``), before the interpreter
    ends daemon threads where they stand (one ended amid a torch call aborted the process:
    ``terminate called``, exit 134, 8 runs in 10)."""
    loader = DataStoreLoader(h5[0], batch_size=1, prefetch=2, shuffle=False)
    batches = iter(loader)  # kept: the pass stays open
    assert next(batches)["idx"].tolist() == [0]
    (worker,) = [w for w, _ in loader._workers]
    assert worker.is_alive() and any(w is worker for w, _ in datastore.loader._PREFETCHING)
    datastore.loader._stop_prefetching()
    assert not worker.is_alive()


def test_every_tensor_a_transform_returns_is_found_for_the_consumer_stream():
    a, b, c = torch.zeros(1), torch.ones(2), torch.arange(3)
    assert tensors_in(a)[0] is a
    found = tensors_in({"x": (a, [b]), "y": c, "meta": "label", "n": 3})
    assert [id(t) for t in found] == [id(a), id(b), id(c)]
    assert tensors_in(("no", 1)) == []


def test_bad_device_and_threads_are_named(h5):
    with pytest.raises(ValueError, match="threads"):
        DataStoreLoader(h5[0], batch_size=2, threads=0)
    with pytest.raises(ValueError, match="device"):
        DataStoreLoader(h5[0], batch_size=2, device="nonsense")
    with pytest.raises(ValueError, match=r"^device='meta' holds no data"):
        DataStoreLoader(h5[0], batch_size=2, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            DataStoreLoader(h5[0], batch_size=2, device="cuda")


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"fields": []}, ValueError, r"fields=\[\] names no field"),
        ({"seed": "abc"}, ValueError, "seed must be an int, got 'abc'"),
        ({"seed": 1.5}, ValueError, "seed must be an int, got 1.5"),
        # embedded such seeds were taken; datastore serve's "Value out of range: -5" named none
        ({"seed": -5}, ValueError, r"^seed must be between 0 and 2\*\*64 - 1, got -5$"),
        ({"seed": 2**64}, ValueError, r"^seed must be between 0 and 2\*\*64 - 1, got 1844"),
        ({"drop_last": "no"}, ValueError, "drop_last must be True or False, got 'no'"),
        ({"prefetch": True}, ValueError, "^prefetch must be an int >= 1, got True$"),  # was 1
        ({"threads": True}, ValueError, "^threads must be an int >= 1, got True$"),
        ({"timeout": "5"}, ValueError, "timeout must be a number of seconds, got '5'"),
        ({"timeout": float("inf")}, ValueError, "timeout must be > 0 seconds and finite"),
        ({"rank": "0", "world": "1"}, ValueError, "rank must be an int, got '0'"),
        ({"transform": 5}, TypeError, "transform must be a function of the batch, got 5"),
        ({"collate": "x"}, TypeError, "collate must be a function of the batch"),
        ({"store": {"preload": False}}, TypeError, r"store= takes StoreOptions\(...\) or None"),
        ({"exchange": False}, TypeError, r"exchange= takes ExchangeOptions\(...\) or None"),
        ({"service": "unix:///s"}, TypeError, r"service= takes ServiceOptions\(...\) or None"),
        # keywords of before the settings objects say where they went
        ({"address": "unix:///s"}, TypeError, r"address= is now service=ServiceOptions\(addr"),
        (
            {"preload": False, "comm": None, "bogus": 1},
            TypeError,
            r"^DataStoreLoader: bogus= is not an argument; comm= is now "
            r"exchange=ExchangeOptions\(comm=...\); preload= is now store=StoreOptions\(preload",
        ),
        # torch DataLoader's keywords say what does their job here
        (
            {"collate_fn": list, "num_workers": 4},
            TypeError,
            r"^DataStoreLoader: collate_fn= is torch DataLoader's: here collate= \(what "
            r"iteration yields\) or transform= \(per batch\); num_workers= is torch DataLoader's: "
            r"here a thread prefetches \(prefetch=\), threads= copying each batch$",
        ),
    ],
)
def test_careless_arguments_are_named_when_made(h5, kw, error, message):
    with pytest.raises(error, match=message):
        DataStoreLoader(h5[0], batch_size=2, **kw)


@pytest.mark.parametrize("service", [None, ServiceOptions("unix:///nonexistent/ds.sock")])
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (["idx", "idx"], "^fields names 'idx' twice: name each field once$"),
        ([1], r"^fields must be a list of names, got 1 in \[1\]$"),
        (["x", None], r"^fields must be a list of names, got None in \['x', None\]$"),
        (3, "^fields must be a list of names, got 3$"),
    ],
)
def test_bad_fields_are_named_alike_embedded_and_with_a_service(h5, service, fields, message):
    """Before a service is asked: ``fields=[1]`` was ``TypeError: bad argument type for
    built-in operation`` from the service's request, and ``["x", "x"]`` delivered ``x`` once
    there but was refused embedded, as "named twice in the spec" (no spec was given)."""
    with pytest.raises(ValueError, match=message):
        DataStoreLoader(h5[0], batch_size=2, fields=fields, service=service)


@pytest.mark.parametrize("epoch", [1.7, None, "2", -1, True])
def test_set_epoch_refuses_what_is_not_an_epoch(h5, epoch):
    """``set_epoch(1.7)`` went to epoch 1 and ``set_epoch(-1)`` to epoch -1 (whose
    ``state_dict`` no loader would load), silently; ``set_epoch(None)`` was ``TypeError:
    int() argument must be ...``, naming no call."""
    loader = DataStoreLoader(h5[0], batch_size=2)
    with pytest.raises(ValueError, match=rf"^set_epoch takes an int >= 0, got {epoch!r}$"):
        loader.sampler.set_epoch(epoch)
    loader.set_epoch(np.int64(3))
    assert loader.state_dict()["epoch"] == 3


def test_fields_may_be_any_iterable_of_names(h5):
    batch = next(iter(DataStoreLoader(h5[0], batch_size=2, fields=iter(["idx"]))))
    assert list(batch) == ["idx"]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: StoreOptions(preload="no"), ValueError, "StoreOptions.preload must be True or"),
        (
            lambda: StoreOptions(memory_budget=float("nan")),
            ValueError,
            "StoreOptions.memory_budget must be a finite size",
        ),
        (lambda: StoreOptions(memory_budget="lots"), ValueError, "StoreOptions.memory_budget"),
        (  # was a budget of 1 byte: every sample read from disk again on every use
            lambda: StoreOptions(memory_budget=1.5),
            ValueError,
            r"StoreOptions.memory_budget must be whole bytes or a size like '1.5G', got 1.5",
        ),
        (lambda: StoreOptions(spill_dir=5), TypeError, "StoreOptions.spill_dir must be a path"),
        (
            lambda: ExchangeOptions(enabled="yes"),
            ValueError,
            "ExchangeOptions.enabled must be True, False or None",
        ),
        (
            lambda: ExchangeOptions(enabled=False, group=object()),
            ValueError,
            r"ExchangeOptions\(enabled=False\) takes no comm or group",
        ),
        (
            lambda: ServiceOptions(""),
            ValueError,
            "ServiceOptions.address must be 'unix://PATH' or 'HOST:PORT', got ''",
        ),
        (
            lambda: ServiceOptions("unix:///s", transport="bogus"),
            ValueError,
            "ServiceOptions.transport must be one of auto, shm, inline, got 'bogus'",
        ),
        (
            lambda: ServiceOptions("unix:///s", token=5),
            TypeError,
            "ServiceOptions.token must be a string or None, got 5",
        ),
        (
            lambda: ServiceOptions("unix:///s", job_id=None),
            TypeError,
            "ServiceOptions.job_id must be a string",
        ),
    ],
)
def test_careless_source_settings_are_named_when_made(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_the_store_settings_are_refused_with_a_service(h5):
    with pytest.raises(ValueError, match="store= is for the embedded store: with service="):
        DataStoreLoader(
            h5[0], batch_size=2, store=StoreOptions(), service=ServiceOptions("unix:///nowhere")
        )


def test_settings_objects_are_frozen():
    with pytest.raises(AttributeError):
        StoreOptions().preload = False  # type: ignore[misc]


def test_a_spill_dir_that_is_a_file_is_named(h5, tmp_path):
    spill = tmp_path / "spill"
    spill.write_bytes(b"")
    with pytest.raises(ValueError, match=f"spill_dir '{spill}' is not a directory"):
        DataStoreLoader(
            h5[0], batch_size=2, store=StoreOptions(memory_budget=1, spill_dir=str(spill))
        )


def test_a_spill_dir_is_made_only_where_its_parent_exists(h5, tmp_path):
    """``/l/sdd/spill`` for ``/l/ssd/spill``: refused, nothing made (was: the whole path made,
    and spilled into, on whatever disk holds it)."""
    typo = tmp_path / "l" / "sdd" / "spill"
    with pytest.raises(ValueError, match=f"spill_dir '{typo}': its parent '{typo.parent}' is not"):
        StoreOptions(memory_budget=1, spill_dir=typo)
    assert not (tmp_path / "l").exists()
    made = tmp_path / "spill"
    loader = DataStoreLoader(
        h5[0], batch_size=2, store=StoreOptions(memory_budget=1, spill_dir=made)
    )
    assert made.is_dir() and loader.store.spill_slots > 0
    loader.close()


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (np.array([b"a", b"b", b"c"]), "|S1 (bytes8)"),
        (np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]), "|V8 (void64)"),
    ],
    ids=["bytes", "compound"],
)
def test_a_field_no_tensor_can_hold_is_named(tmp_path, data, says):
    """The file is named too, as the readers' other refusals do (it named the field only)."""
    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3, dtype=np.float32)
        f["odd"] = data
    with pytest.raises(ValueError) as err:
        DataStoreLoader(str(path), batch_size=1)
    assert str(err.value) == (
        f"{path}: field 'odd': its dtype {says} has no torch tensor type (numbers and bools "
        "only); leave it out with fields=[...]"
    )
    loader = DataStoreLoader(str(path), batch_size=1, fields=["x"])  # the way out it names
    assert len(list(loader)) == 3
    loader.close()


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


def _big_endian_copies(tmp: Path, x: np.ndarray, y: np.ndarray) -> dict[str, tuple[str, str]]:
    """The same samples in this machine's byte order and big-endian, per format:
    ``{format: (native path, big-endian path)}``."""
    import zarr

    out = {}
    for order, tag in (("<", "le"), (">", "be")):
        xs, ys = x.astype(order + "f4"), y.astype(order + "i8")
        with h5py.File(tmp / f"{tag}.h5", "w") as f:
            f.create_dataset("x", data=xs)
            f.create_dataset("y", data=ys, chunks=(2,))
        (tmp / f"{tag}_npy").mkdir()
        for i in range(len(xs)):
            np.save(tmp / f"{tag}_npy" / f"{i:02d}.npy", xs[i])
        group = zarr.open_group(str(tmp / f"{tag}.zarr"), mode="w")
        group.create_array("x", data=xs, chunks=(1, 1, 4, 4, 4))
        group.create_array("y", data=ys)
        for fmt, path in (("hdf5", f"{tag}.h5"), ("npy", f"{tag}_npy"), ("zarr", f"{tag}.zarr")):
            out.setdefault(fmt, []).append(str(tmp / path))
    return {fmt: tuple(paths) for fmt, paths in out.items()}


def test_big_endian_files_are_delivered_in_this_machines_byte_order(tmp_path):
    """Big-endian fields (files written on such machines, or with h5py/zarr asked for '>f4')
    were refused; they are now read and swapped, whole samples and blocks with a halo alike:
    the batches equal those of a native copy, sample for sample."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 2, 8, 8, 8)).astype(np.float32)
    y = np.arange(6, dtype=np.int64) * 1_000_003
    spatial = {"parts": (2, 1, 1), "halo": 1}
    for fmt, (native, big) in _big_endian_copies(tmp_path, x, y).items():
        for kw in ({}, {"spatial": spatial, "rank": 1, "world": 2}):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # two ranks without MPI: each reads for itself
                runs = [
                    list(DataStoreLoader(p, batch_size=2, seed=3, drop_last=False, **kw))
                    for p in (native, big)
                ]
            want, got = runs
            assert len(got) == len(want) == 3, fmt
            for a, b in zip(want, got, strict=True):
                assert a.keys() == b.keys()
                for k in a:
                    assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (fmt, k, kw)

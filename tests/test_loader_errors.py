"""The same documented errors embedded and remote: a missing dataset, a path outside the
service's roots, a service that is not there (a real ``datastore serve`` subprocess); the same
from the service's ``Client``, never a raw ``grpc.RpcError``."""

from __future__ import annotations

import json
import os
import signal
import socket

import h5py
import numpy as np
import pytest
import torch

from datastore import DataStoreLoader, describe_dataset
from datastore.errors import DatasetNotFound, DataStoreError, PathNotAllowed, ServiceUnavailable
from datastore.service.client import Client
from datastore.sources.describe import hold_datasets
from datastore.sources.options import ServiceOptions
from tests.test_service_basic import Server, wait_serving
from tests.test_service_stream import assert_same, batches


@pytest.fixture(scope="module")
def allowed(tmp_path_factory):
    """``(root, outside, socket)``: a service allowed ``root`` only; a dataset in each place."""
    tmp = tmp_path_factory.mktemp("errors")
    root, outside = tmp / "root", tmp / "outside"
    for d in (root, outside):
        d.mkdir()
        for name in ("d.h5", "e.h5"):
            with h5py.File(d / name, "w") as f:
                f["x"] = np.arange(12, dtype=np.float32).reshape(4, 3) + len(name)
                f.attrs["datastore_layout"] = "shards"  # a set of them: shards of 4 samples
    (root / "links").mkdir()  # under the root by name, its files outside once resolved
    for name in ("d.h5", "e.h5"):
        (root / "links" / name).symlink_to(outside / name)
    for name, target in (("gone.json", root / "gone.h5"), ("away.json", outside / "d.h5")):
        spec = {"format": "hdf5", "paths": [str(target)]}
        (root / name).write_text(json.dumps(spec))
    runtime = tmp / "runtime"
    runtime.mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "XDG_STATE_HOME": str(tmp / "state")}
    sock = tmp / "s.sock"
    s = Server(tmp / "logs", ["--socket", str(sock), "--allow", str(root)], env)
    wait_serving(s.listening(30)[0], s.proc, timeout=30)
    yield root, outside, sock
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(10)


def test_a_field_no_tensor_can_hold_is_named_in_both_modes(allowed):
    root, _, sock = allowed
    path = root / "strings.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(4, dtype=np.float32)
        f["name"] = np.array([b"a", b"b", b"c", b"d"])
    says = (
        "field 'name': its dtype |S1 (bytes8) has no torch tensor type (numbers and bools "
        "only); leave it out with fields=[...]"
    )
    for kw, where in (({}, str(path)), ({"service": ServiceOptions(str(sock))}, repr(str(path)))):
        with pytest.raises(ValueError) as err:  # the file named too (it was not)
            DataStoreLoader(str(path), batch_size=2, **kw)
        assert str(err.value) == f"{where}: {says}"


def test_a_dataset_with_no_samples_is_named_in_both_modes(allowed):
    root, _, sock = allowed
    path = root / "empty.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((0, 3), dtype=np.float32)
    for kw in ({}, {"service": ServiceOptions(str(sock))}):
        with pytest.raises(ValueError, match=r"empty\.h5'?: the dataset has no samples$"):
            DataStoreLoader(str(path), batch_size=2, **kw)


def test_a_closed_loader_says_so_when_iterated_in_both_modes(allowed):
    """Iterating after ``close()`` (or a ``with`` block) raised ``KeyError: 'x'`` from the
    freed store; a pass open at the close is stopped with the loader, and says so too."""
    root, _, sock = allowed
    for kw in ({}, {"service": ServiceOptions(str(sock))}):
        with DataStoreLoader(str(root / "d.h5"), batch_size=1, seed=0, **kw) as loader:
            it = iter(loader)
            first = next(it)
            held = first["x"].clone()
        for again in (it, iter(loader)):  # the pass open at the close, a new one
            with pytest.raises(RuntimeError, match=r"^this loader is closed \(close\(\), or"):
                next(again)
        loader.close()  # again: nothing
        assert torch.equal(first["x"], held)  # what was handed out stays valid


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("nope.h5", r"nope\.h5"),  # no such file
        ("nope-*.h5", r"nope-\*\.h5"),  # a glob that matches nothing
        ("nope.json", r"nope\.json"),  # no such spec file
        ("gone.json", r"gone\.h5"),  # a spec naming a file that is not there
    ],
)
def test_a_missing_dataset_is_dataset_not_found_in_both_modes(allowed, name, says):
    root, _, sock = allowed
    missing = str(root / name)
    for kw in ({}, {"service": ServiceOptions(str(sock))}):
        with pytest.raises(DatasetNotFound, match=says) as e:
            DataStoreLoader(missing, batch_size=2, **kw)
        assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, DataStoreError)


def test_a_path_outside_the_allowed_roots_is_path_not_allowed(allowed):
    root, outside, sock = allowed
    with pytest.raises(PathNotAllowed, match="outside the allowed roots") as e:
        DataStoreLoader(str(outside / "d.h5"), batch_size=2, service=ServiceOptions(str(sock)))
    assert isinstance(e.value, PermissionError)
    with DataStoreLoader(str(root / "d.h5"), batch_size=2, service=ServiceOptions(str(sock))) as ok:
        assert [tuple(b["x"].shape) for b in ok] == [(2, 3), (2, 3)]


@pytest.mark.parametrize(
    ("name", "reads"),
    [("links", r"outside/d\.h5' \(through '.*links/d\.h5'\)"), ("away.json", r"outside/d\.h5'")],
)
def test_a_dataset_whose_files_lie_outside_the_allowed_roots_is_path_not_allowed(
    allowed, name, reads
):
    """Under the root by name, but reading files outside it: through links in a directory, or
    a spec file naming another place. Embedded (no roots) it reads them."""
    root, _, sock = allowed
    with pytest.raises(PathNotAllowed, match=reads + ", outside the allowed roots"):
        DataStoreLoader(str(root / name), batch_size=2, service=ServiceOptions(str(sock)))
    with DataStoreLoader(str(root / name), batch_size=2) as embedded:
        assert batches(embedded)  # its two files are two samples: one batch


def test_a_field_linked_to_a_file_outside_the_roots_is_refused_before_it_is_described(allowed):
    """An HDF5 file under the root whose field is an external link to a file outside: Describe
    showed that file's field (8 samples, float64 (5,)); then the load failed ``DATA_LOSS``."""
    root, outside, sock = allowed
    with h5py.File(outside / "hidden.h5", "w") as f:
        f["hidden"] = np.zeros((8, 5))
    with h5py.File(root / "ext.h5", "w") as f:
        f["x"] = h5py.ExternalLink(str(outside / "hidden.h5"), "hidden")
    says = (
        f"{str(root / 'ext.h5')!r} reads {str(outside / 'hidden.h5')!r} (named in its files), "
        f"outside the allowed roots ({root})"
    )
    with pytest.raises(PathNotAllowed) as e:
        describe_dataset(str(root / "ext.h5"), ServiceOptions(str(sock)), timeout=30)
    assert str(e.value) == says
    with pytest.raises(PathNotAllowed) as e:
        DataStoreLoader(str(root / "ext.h5"), batch_size=2, service=ServiceOptions(str(sock)))
    assert str(e.value) == says


def test_a_glob_under_the_root_is_served_as_embedded(allowed):
    root, _, sock = allowed
    pattern = str(root / "[de].h5")
    local = DataStoreLoader(pattern, batch_size=2, seed=4)
    with DataStoreLoader(
        pattern, batch_size=2, seed=4, service=ServiceOptions(str(sock))
    ) as remote:
        assert_same(batches(remote), batches(local))
    local.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["socket", "tcp"])
def test_no_service_at_the_address_says_so(tmp_path, where):
    address = str(tmp_path / "nobody.sock") if where == "socket" else f"127.0.0.1:{free_port()}"
    says = f"is `datastore serve` running at {address}\\?"
    with pytest.raises(ServiceUnavailable, match=says) as e:
        DataStoreLoader(
            str(tmp_path / "d.h5"), batch_size=2, timeout=5, service=ServiceOptions(address)
        )
    assert isinstance(e.value, ConnectionError)
    with Client(address, timeout_s=5) as c, pytest.raises(ServiceUnavailable, match=says):
        c.status()


def test_the_client_raises_the_same_errors(allowed):
    root, outside, sock = allowed
    with Client(sock) as c:
        with pytest.raises(DatasetNotFound, match=r"no dataset at .*nope\.h5"):
            c.load(str(root / "nope.h5"))
        with pytest.raises(PathNotAllowed, match="outside the allowed roots"):
            c.load(str(outside / "d.h5"))
        with pytest.raises(PathNotAllowed, match="outside the allowed roots"):
            c.load(str(root / "links"))
        with pytest.raises(ValueError, match="dataset_path must be absolute"):
            c.load("d.h5")
        assert c.load(str(root / "d.h5"), wait=True).dataset.num_samples == 4


def test_describe_dataset_is_the_same_in_both_modes_and_names_the_missing_one(allowed):
    root, _, sock = allowed
    path = str(root / "d.h5")
    here = describe_dataset(path)
    served = describe_dataset(path, ServiceOptions(str(sock)), timeout=30)
    assert here == served and here[0] == 4 and list(here[1]) == ["x"]
    assert here[1]["x"].shape == (3,) and here[1]["x"].dtype == np.float32
    for service in (None, ServiceOptions(str(sock))):
        with pytest.raises(DatasetNotFound, match=r"nope\.h5"):
            describe_dataset(str(root / "nope.h5"), service, timeout=30)
    with pytest.raises(TypeError, match=r"service= takes ServiceOptions\(...\) or None"):
        describe_dataset(path, str(sock))


def test_hold_datasets_makes_them_resident_and_names_the_missing_one(allowed):
    root, _, sock = allowed
    path = str(root / "e.h5")
    hold_datasets([path], ServiceOptions(str(sock)), timeout=30)
    with Client(sock, timeout_s=10) as c:
        held = {d.path: d for d in c.status().datasets}
    assert not held[path].loading and held[path].bytes_resident == held[path].bytes_total == 48
    with pytest.raises(DatasetNotFound, match=r"nope\.h5"):
        hold_datasets([str(root / "nope.h5")], ServiceOptions(str(sock)), timeout=30)


def test_no_batch_within_says_the_time_it_waited(tmp_path, monkeypatch):
    """A producer that gives nothing: the error said "no batch within 10 s" when the loader had
    waited 15 s (the timeout, and 5 s more for the producer's own error); now the real wait."""
    import datastore.loader as loader_module
    from datastore.errors import ExchangeTimeout

    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = np.zeros((4, 3), np.float32)
    monkeypatch.setattr(loader_module, "NAMING_WAIT_S", 0.25, raising=False)
    loader = DataStoreLoader(str(tmp_path / "d.h5"), batch_size=1, timeout=0.5)

    def stalled(epoch, start, stop, ring):
        stop.wait()
        yield from ()

    monkeypatch.setattr(loader._source, "batches", stalled)
    try:
        with pytest.raises(ExchangeTimeout) as err:
            next(iter(loader))
        assert str(err.value).startswith(
            "no batch within 0.75 s (the timeout, 0.5 s, and 0.25 s for the cause; rank 0, "
            "epoch 0 step 0): "
        ), err.value
    finally:
        loader.close()

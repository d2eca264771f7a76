"""The same documented errors embedded and remote: a missing dataset, a path outside the
service's roots, a service that is not there (a real ``datastore serve`` subprocess)."""

from __future__ import annotations

import os
import signal

import h5py
import numpy as np
import pytest

from datastore import DataStoreLoader
from datastore.errors import DatasetNotFound, DataStoreError, PathNotAllowed, ServiceUnavailable
from tests.test_service_basic import Server, wait_serving


@pytest.fixture(scope="module")
def allowed(tmp_path_factory):
    """``(root, outside, socket)``: a service allowed ``root`` only; a dataset in each place."""
    tmp = tmp_path_factory.mktemp("errors")
    root, outside = tmp / "root", tmp / "outside"
    for d in (root, outside):
        d.mkdir()
        with h5py.File(d / "d.h5", "w") as f:
            f["x"] = np.zeros((4, 3), np.float32)
    runtime = tmp / "runtime"
    runtime.mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "XDG_STATE_HOME": str(tmp / "state")}
    sock = tmp / "s.sock"
    s = Server(tmp / "logs", ["--socket", str(sock), "--allow", str(root)], env)
    wait_serving(s.listening(30)[0], s.proc, timeout=30)
    yield root, outside, sock
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(10)


def test_a_missing_dataset_is_dataset_not_found_in_both_modes(allowed):
    root, _, sock = allowed
    missing = str(root / "nope.h5")
    for kw in ({}, {"address": str(sock)}):
        with pytest.raises(DatasetNotFound, match=r"nope\.h5") as e:
            DataStoreLoader(missing, batch_size=2, **kw)
        assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, DataStoreError)


def test_a_path_outside_the_allowed_roots_is_path_not_allowed(allowed):
    root, outside, sock = allowed
    with pytest.raises(PathNotAllowed, match="outside the allowed roots") as e:
        DataStoreLoader(str(outside / "d.h5"), batch_size=2, address=str(sock))
    assert isinstance(e.value, PermissionError)
    with DataStoreLoader(str(root / "d.h5"), batch_size=2, address=str(sock)) as ok:
        assert [tuple(b["x"].shape) for b in ok] == [(2, 3), (2, 3)]


def test_no_service_at_the_address_says_so(tmp_path):
    sock = tmp_path / "nobody.sock"
    with pytest.raises(ServiceUnavailable, match="is `datastore serve` running at") as e:
        DataStoreLoader(str(tmp_path / "d.h5"), batch_size=2, address=str(sock), timeout=5)
    assert isinstance(e.value, ConnectionError) and str(sock) in str(e.value)

"""Two services under ``mpiexec -n 2`` form one store over a dataset staged with ``--mode shard``.

Each service owns the files staged on "its node" (``node{node}`` directories on this host); a
job whose ranks stream from different services gets exactly the embedded loader's batches over
the whole dataset, the blocks that live on the other node being fetched over MPI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import MPIEXEC, stage_sharded

from datastore.errors import ServiceUnavailable
from datastore.loader import DataStoreLoader
from datastore.service.client import Client
from datastore.sources.options import ExchangeOptions, ServiceOptions
from tests.test_service_stream import assert_same, batches

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """``(source dir, dataset template, [socket paths], mpiexec process)``."""
    tmp = tmp_path_factory.mktemp("nodes")
    src, env = stage_sharded(tmp)
    serve = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "datastore", "serve"]
    serve += ["--socket", str(tmp / "s{rank}.sock")]
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT)
    sockets = [tmp / "s0.sock", tmp / "s1.sock"]
    deadline = time.monotonic() + 60
    while not all(s.exists() for s in sockets):
        assert proc.poll() is None, (tmp / "serve.log").read_text()
        assert time.monotonic() < deadline, "the services did not start"
        time.sleep(0.2)
    yield src, str(tmp / "node{node}" / "src"), sockets, proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    log.close()


@pytest.mark.parametrize(
    "spatial", [None, {"parts": (2, 1, 1), "halo": (1, 1, 1)}], ids=["whole", "blocks"]
)
def test_a_job_across_two_services_gets_the_embedded_batches(store, spatial):
    src, template, sockets, _ = store
    for rank in range(2):
        kw = {"rank": rank, "world": 2, "seed": 5, "spatial": spatial}
        remote = DataStoreLoader(
            template, batch_size=2, service=ServiceOptions(str(sockets[rank])), **kw
        )
        local = DataStoreLoader(
            str(src), batch_size=2, exchange=ExchangeOptions(enabled=False), **kw
        )
        try:
            for _ in range(2):
                assert_same(batches(remote), batches(local))
        finally:
            remote.close()
            local.close()
    for rank, sock in enumerate(sockets):
        with Client(sock) as c:
            st = c.status()
        assert (st.node, st.nodes) == (rank, 2)
        assert st.bytes_exchanged > 0  # some of every batch lived on the other node
        (ds,) = st.datasets
        assert ds.num_samples == 20 and ds.local_samples == 10


@pytest.mark.parametrize(
    ("spatial", "transport", "prefetch"),
    [(None, "shm", 1), ({"parts": (2, 1, 1), "halo": (1, 1, 1)}, "inline", 4)],
    ids=["whole-shm-ahead1", "blocks-inline-ahead3"],
)
def test_fetch_ahead_keeps_the_embedded_batches_across_a_partial_step_and_epochs(
    store, spatial, transport, prefetch
):
    """Batches of 3 per rank over 20 samples: the last step of each epoch is partial (padded,
    ``valid`` saying which), and the fetches of the next steps (1 or 3 ahead) end with the
    epoch."""
    src, template, sockets, _ = store
    for rank in range(2):
        kw = {"rank": rank, "world": 2, "seed": 7, "spatial": spatial, "drop_last": False}
        service = ServiceOptions(str(sockets[rank]), transport=transport)
        remote = DataStoreLoader(template, batch_size=3, service=service, prefetch=prefetch, **kw)
        local = DataStoreLoader(
            str(src), batch_size=3, exchange=ExchangeOptions(enabled=False), **kw
        )
        try:
            for _ in range(3):
                got, want = batches(remote), batches(local)
                assert not got[-1]["valid"].all()  # the partial last step, padded
                assert_same(got, want)
        finally:
            remote.close()
            local.close()


def test_a_stream_left_mid_epoch_leaves_its_slots_clean_for_the_next(store):
    """A client that stops reading after one batch (its stream stopped with fetches in flight,
    abandoned before its slots are reused), then a new loader on the same session's ring: the
    embedded batches, byte for byte."""
    src, template, sockets, _ = store
    kw = {"rank": 1, "world": 2, "seed": 11, "spatial": None}
    service = ServiceOptions(str(sockets[1]), transport="shm")
    for cut in (1, 2):
        remote = DataStoreLoader(template, batch_size=2, service=service, prefetch=4, **kw)
        local = DataStoreLoader(
            str(src), batch_size=2, exchange=ExchangeOptions(enabled=False), **kw
        )
        try:
            assert_same(batches(remote, cut), batches(local, cut))  # then left mid-epoch
            assert_same(batches(remote), batches(local))
            assert_same(batches(remote), batches(local))
        finally:
            remote.close()
            local.close()


def test_shutdown_of_one_service_stops_the_store(store):
    _, _, sockets, proc = store
    with Client(sockets[1]) as c:
        assert c.shutdown(reason="test").accepted
    assert proc.wait(30) == 0
    assert not any(s.exists() for s in sockets)
    with Client(sockets[0], timeout_s=2) as c, pytest.raises(ServiceUnavailable):
        c.status()

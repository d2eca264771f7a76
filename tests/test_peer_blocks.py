"""Blocks split across the last axis through two services under ``mpiexec -n 2``: a block's
part inside the volume is strided in the owner's sample and amid its halo in the asker's slot,
with the halo outside the volume on a different side for each rank; the job gets exactly the
embedded loader's batches, epoch after epoch (the asker's reused buffers for parts received
aside never leak one batch's bytes into another)."""

from __future__ import annotations

import pytest

from datastore.loader import DataStoreLoader
from datastore.sources.options import ExchangeOptions, ServiceOptions
from tests.test_service_nodes import store  # noqa: F401 - the two services, as a fixture
from tests.test_service_stream import assert_same, batches

pytestmark = pytest.mark.mpi


def test_blocks_split_on_the_last_axis_arrive_exactly(store):  # noqa: F811
    src, template, sockets, _ = store
    spatial = {"parts": (1, 1, 2), "halo": (1, 1, 1)}  # samples (2, 6, 4, 4): boxes (8, 6, 4)
    for rank in range(2):
        kw = {"rank": rank, "world": 2, "seed": 3, "spatial": spatial, "drop_last": False}
        remote = DataStoreLoader(
            template, batch_size=3, service=ServiceOptions(str(sockets[rank])), **kw
        )
        local = DataStoreLoader(
            str(src), batch_size=3, exchange=ExchangeOptions(enabled=False), **kw
        )
        try:
            for _ in range(3):
                assert_same(batches(remote), batches(local))
        finally:
            remote.close()
            local.close()

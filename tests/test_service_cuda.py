"""``datastore serve`` over shared memory to a GPU (``device="cuda"``): the segment page-locked
(``cudaHostRegister``), batches copied to the device straight from it, each epoch after the
first beginning with batches asked for ahead. Skipped without CUDA; the same passes on the CPU
are ``test_service_stream``'s."""

from __future__ import annotations

import pytest
import torch

from datastore.loader import DataStoreLoader
from datastore.sources.options import ExchangeOptions, ServiceOptions
from tests.test_service_stream import served  # noqa: F401 (the module's server)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_cuda_service_batches_over_shared_memory_equal_the_embedded_ones(served):  # noqa: F811
    path, sock, _ = served
    kw = {"batch_size": 4, "seed": 3, "prefetch": 2}
    remote = DataStoreLoader(
        str(path), device="cuda", service=ServiceOptions(str(sock), transport="shm"), **kw
    )
    local = DataStoreLoader(str(path), exchange=ExchangeOptions(enabled=False), **kw)
    bad, steps = [], 0
    try:
        for epoch in range(3):
            remote.set_epoch(epoch)
            local.set_epoch(epoch)
            for step, (r, x) in enumerate(zip(remote, local, strict=True)):
                steps += 1
                if r.keys() != x.keys() or not all(
                    r[k].is_cuda and torch.equal(r[k].cpu(), x[k]) for k in x
                ):
                    bad.append((epoch, step))
        pinned = remote._source._maps.pinned
    finally:
        remote.close()
        local.close()
    assert steps == 18 and not bad, f"(epoch, step) of {steps} batches unlike the embedded: {bad}"
    assert pinned == 1, (
        f"{pinned} shared-memory segments page-locked, not 1: cudaHostRegister refused the "
        "mapping, so the service's batches reach the GPU by pageable copies"
    )

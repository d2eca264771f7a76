"""Pinned memory and device copies on a real GPU (issue 23, items 1a-1c).

Each test queues a copy behind a long kernel (``torch.cuda._sleep``) so that the copy is still
in flight while the host goes on; a buffer reused or unlocked too early shows as wrong bytes.
Skipped without CUDA; the logic they rely on is tested on the CPU in ``test_pinning.py``.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from datastore import DataStoreLoader
from datastore.service.shm import ClientMaps, Segment

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BATCH, STEPS = 4, 8
SLEEP = 100_000_000  # GPU clock cycles: about 50-60 ms on an H100


@pytest.fixture(scope="module")
def h5(tmp_path_factory):
    """``x``: 32 samples of 2 MiB, each different: 8 MiB batches."""
    x = np.random.default_rng(0).random((BATCH * STEPS, 2, 64, 64, 64), dtype=np.float32)
    path = tmp_path_factory.mktemp("pinned") / "x.h5"
    with h5py.File(path, "w") as f:
        f["x"] = x
    return str(path), x


def test_cuda_pinned_batches_keep_their_bytes_while_a_non_blocking_copy_waits(h5):
    path, x = h5
    loader = DataStoreLoader(path, batch_size=BATCH, shuffle=False, pin_memory=True, prefetch=2)
    got = []
    for step, b in enumerate(loader):  # the loader runs ahead: the GPU is far behind the host
        torch.cuda._sleep(SLEEP * (5 if step == 0 else 1))
        got.append(b["x"].cuda(non_blocking=True))  # queued behind the sleep
        del b
    torch.cuda.synchronize()
    loader.close()
    bad = [
        s
        for s, g in enumerate(got)
        if not torch.equal(g.cpu(), torch.from_numpy(x[s * BATCH : (s + 1) * BATCH]))
    ]
    assert len(got) == STEPS and not bad, (
        f"steps {bad} of {len(got)}: a pinned buffer was overwritten while the consumer's "
        f"non_blocking copy from it was in flight (ring fresh={loader.ring.fresh})"
    )


def test_cuda_device_stages_through_pinned_buffers_without_pin_memory(h5):
    path, x = h5
    loader = DataStoreLoader(path, batch_size=BATCH, shuffle=False, device="cuda", prefetch=2)
    buf = loader.ring.take()
    try:
        pinned = {name: t.is_pinned() for name, t in buf.tensors.items()}
    finally:
        loader.ring.give_back(buf)
    assert loader.ring.pin and all(pinned.values()), (
        f"device='cuda' staged batches in pageable memory: ring.pin={loader.ring.pin}, "
        f"is_pinned {pinned}"
    )
    for step, b in enumerate(loader):
        want = torch.from_numpy(x[step * BATCH : (step + 1) * BATCH])
        assert b["x"].is_cuda and torch.equal(b["x"].cpu(), want), f"step {step}"
    loader.close()


def test_cuda_drop_waits_for_the_copy_out_of_the_mapping_before_unlocking():
    """The copy is queued late on its stream, behind a sleep. (Whether drop() waits for other
    streams too is not asserted: on the H100 it did, the unlocking waits for the whole GPU.)"""
    n = 16 << 20
    seg = Segment(1, n)  # a real shared-memory file, as the service makes
    try:
        pattern = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        seg.array(0, 0, np.dtype(np.uint8), (n,))[:] = pattern
        copies = torch.cuda.Stream()
        maps = ClientMaps(copies_on=copies)
        host = maps.array(str(seg.path), 0, np.dtype(np.uint8), (n,))
        assert maps.pinned == 1, "cudaHostRegister refused the mapping: the copy would not be async"
        with torch.cuda.stream(copies):  # the loader's copy out of the mapping, queued late
            torch.cuda._sleep(SLEEP)
            out = torch.from_numpy(host).to("cuda", non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        maps.drop()
        copy_done = copied.query()
        host[:] = 0  # unlocked and no longer ours: a copy still reading it would see zeros
        torch.cuda.synchronize()
        assert copy_done, "drop() unlocked the mapping before the copy out of it was done"
        assert torch.equal(out.cpu(), torch.from_numpy(pattern)), "the copy read changed bytes"
    finally:
        seg.close()

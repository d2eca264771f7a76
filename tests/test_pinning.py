"""What the loader pins and when it reuses a buffer, tested on the CPU (issue 23, items 1a-1c);
the same on a GPU, with copies in flight, is in ``test_pinned_cuda.py``."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from datastore import DataStoreLoader
from datastore.maths.delivery import delivered_fields
from datastore.readers.base import FieldInfo
from datastore.service.shm import ClientMaps, Segment
from datastore.store.ring import BufferRing, staging_pinned

INFO = {"x": FieldInfo(name="x", dtype=np.dtype("float32"), shape=(3, 4), spatial_axes=())}


@pytest.mark.parametrize(
    ("pin_memory", "device", "pinned"),
    [
        (False, None, False),
        (True, None, True),
        (False, torch.device("cuda", 1), True),  # the side-stream copies need pinned memory
        (True, torch.device("cuda", 0), True),
        (False, torch.device("meta"), False),
    ],
)
def test_staging_is_pinned_when_asked_or_for_a_gpu_device(pin_memory, device, pinned):
    assert staging_pinned(pin_memory, device) is pinned


def test_a_fresh_ring_makes_a_new_buffer_per_batch_and_lets_free_ones_go():
    ring = BufferRing(delivered_fields(INFO, None, 0), 2, keep=2, fresh=True)
    a = ring.take()
    a.arrays["x"][:] = 1
    held = a.views()["x"]  # the consumer keeps batch a
    b = ring.take()
    b.views()  # and drops batch b
    c = ring.take()
    assert len({id(a), id(b), id(c)}) == 3
    assert len(ring) == 2 and ring.made == 3  # b went; a is held, c is pending
    del held
    c.views()
    d = ring.take()
    assert len(ring) == 1 and d is not a and d is not c
    assert torch.equal(a.tensors["x"], torch.ones(2, 3, 4))  # a never written by the ring


def test_a_reusing_ring_hands_a_free_buffer_back():
    ring = BufferRing(delivered_fields(INFO, None, 0), 2, keep=2)
    a = ring.take()
    a.views()
    assert ring.take() is a and ring.made == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="pin_memory is honoured where CUDA is")
def test_pin_memory_without_a_gpu_keeps_reusing_pageable_buffers(tmp_path):
    path = tmp_path / "x.h5"
    x = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
    with h5py.File(path, "w") as f:
        f["x"] = x
    with pytest.warns(UserWarning, match="pin_memory needs CUDA"):
        loader = DataStoreLoader(str(path), batch_size=2, shuffle=False, pin_memory=True)
    assert not loader.ring.pin and not loader.ring.fresh
    for _ in range(3):
        got = [b["x"].clone() for b in loader]
        assert torch.equal(torch.cat(got), torch.from_numpy(x))
    assert loader.ring.made <= 4  # prefetch + 2 buffers, reused epoch after epoch
    loader.close()


def test_client_maps_without_a_copy_stream_map_pageable_and_drop_with_no_gpu_call():
    seg = Segment(1, 4096)
    try:
        seg.array(0, 0, np.dtype(np.int32), (8,))[:] = np.arange(8)
        maps = ClientMaps()
        view = maps.array(str(seg.path), 0, np.dtype(np.int32), (8,))
        assert maps.pinned == 0 and str(seg.path) in maps
        maps.drop()  # no CUDA call: nothing was page-locked
        assert str(seg.path) not in maps
        assert view.tolist() == list(range(8))  # a view outlives the mapping's entry
    finally:
        seg.close()

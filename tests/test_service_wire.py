"""Hand-framed ``Batch`` bytes parse to exactly the message protobuf builds."""

from __future__ import annotations

import numpy as np

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.wire import frame_batch, serialize


def test_framed_batch_equals_the_protobuf_message():
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal((2, 3, 5, 4, 4)).astype(np.float32),
        np.arange(300, dtype=np.int64),  # a payload over 127 bytes: multi-byte lengths
        np.zeros((0,), np.float64),
    ]
    metas = [
        pb.TensorMeta(name=f"f{i}", dtype=a.dtype.str, shape=list(a.shape), nbytes=a.nbytes)
        for i, a in enumerate(arrays)
    ]
    header = pb.Batch(epoch=3, step=7, rank=1, sample_indices=[5, 900, 2], last_in_epoch=True)
    framed = frame_batch(header, list(zip(metas, arrays, strict=True)))
    expected = pb.Batch()
    expected.CopyFrom(header)
    for m, a in zip(metas, arrays, strict=True):
        expected.tensors.add(meta=m, data=a.tobytes())
    assert pb.Batch.FromString(framed) == expected
    assert serialize(framed) is framed
    assert serialize(expected) == expected.SerializeToString()

"""Hand-framed ``Batch`` bytes parse to exactly the message protobuf builds, and
``parse_batch`` reads any ``Batch`` exactly as ``Batch.FromString`` does, payloads as views."""

from __future__ import annotations

import numpy as np
import pytest

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.stream import _pieces
from datastore.service.wire import (
    ReceivedBatch,
    chunk_message,
    frame_batch,
    keep_large_blocks,
    parse_batch,
    serialize,
)


def arrays_and_metas() -> tuple[list[np.ndarray], list[pb.TensorMeta]]:
    rng = np.random.default_rng(0)
    arrays = [
        rng.standard_normal((2, 3, 5, 4, 4)).astype(np.float32),
        np.arange(300, dtype=np.int64),  # a payload over 127 bytes: multi-byte lengths
        np.zeros((0,), np.float64),
        np.asfortranarray(rng.standard_normal((3, 4))),  # framed in C order
    ]
    metas = [
        pb.TensorMeta(name=f"f{i}", dtype=a.dtype.str, shape=list(a.shape), nbytes=a.nbytes)
        for i, a in enumerate(arrays)
    ]
    return arrays, metas


HEADER = pb.Batch(epoch=3, step=7, rank=1, sample_indices=[5, 900, 2], last_in_epoch=True)


def as_message(b: ReceivedBatch) -> pb.Batch:
    """The ``Batch`` a parsed message stands for."""
    out = pb.Batch()
    out.CopyFrom(b.header)
    for t in b.tensors:
        m = out.tensors.add(meta=t.meta)
        if t.data is not None:
            m.data = bytes(t.data)
        elif t.shm is not None:
            m.shm.CopyFrom(t.shm)
    return out


def test_framed_batch_equals_the_protobuf_message():
    arrays, metas = arrays_and_metas()
    framed = frame_batch(HEADER, list(zip(metas, arrays, strict=True)))
    expected = pb.Batch()
    expected.CopyFrom(HEADER)
    for m, a in zip(metas, arrays, strict=True):
        expected.tensors.add(meta=m, data=a.tobytes())
    assert pb.Batch.FromString(framed) == expected
    assert serialize(framed) is framed
    assert serialize(expected) == expected.SerializeToString()


def test_parse_framed_batch_gives_views_of_the_message():
    arrays, metas = arrays_and_metas()
    framed = frame_batch(HEADER, list(zip(metas, arrays, strict=True)))
    got = parse_batch(framed)
    assert as_message(got) == pb.Batch.FromString(framed)
    assert got.header == HEADER and not got.header.tensors
    for t, m, a in zip(got.tensors, metas, arrays, strict=True):
        assert t.meta == m and t.shm is None
        assert t.data is not None and t.data.obj is framed  # a view, not a copy
        view = np.frombuffer(t.data, a.dtype).reshape(a.shape)
        np.testing.assert_array_equal(view, a)


def test_parse_equals_from_string_on_protobuf_built_messages():
    arrays, metas = arrays_and_metas()
    inline = pb.Batch()
    inline.CopyFrom(HEADER)
    for m, a in zip(metas, arrays, strict=True):
        inline.tensors.add(meta=m, data=a.tobytes())
    shared = pb.Batch(step=2, last_in_epoch=False)
    for i, m in enumerate(metas):
        region = pb.SharedMemoryRegion(path="/dev/shm/x", offset=64 * i, length=9, generation=4)
        shared.tensors.add(meta=m, shm=region)
    shared.tensors.add(meta=pb.TensorMeta(name="no payload"))
    messages = [pb.Batch(), HEADER, inline, shared]
    for msg in messages:
        raw = msg.SerializeToString()
        got = parse_batch(raw)
        assert as_message(got) == pb.Batch.FromString(raw) == msg
        kinds = [(t.data is not None, t.shm is not None) for t in got.tensors]
        want = [(t.WhichOneof("payload") == "data", t.HasField("shm")) for t in msg.tensors]
        assert kinds == want
    # protobuf's merge rules: concatenated messages merge, the last payload of a tensor wins,
    # a repeated meta merges, unknown fields of a tensor are dropped
    meta_a, meta_b = pb.TensorMeta(name="x").SerializeToString(), pb.TensorMeta(nbytes=4)
    tensor = (
        b"\x0a" + bytes([len(meta_a)]) + meta_a
        + b"\x12\x02ab"
        + b"\x0a" + bytes([meta_b.ByteSize()]) + meta_b.SerializeToString()
        + b"\x1a\x02\x08\x05"  # shm (its path as a varint: an unknown field), then data
        + b"\x12\x03xyz"
        + b"\xf8\x01\x07"  # field 31, varint: unknown
    )  # fmt: skip
    raw = HEADER.SerializeToString() + b"\x2a" + bytes([len(tensor)]) + tensor
    raw += shared.SerializeToString()
    got = parse_batch(raw)
    expected = pb.Batch.FromString(raw)
    expected.tensors[0].DiscardUnknownFields()
    assert as_message(got) == expected
    assert got.tensors[0].meta == pb.TensorMeta(name="x", nbytes=4)
    assert bytes(got.tensors[0].data) == b"xyz" and got.tensors[0].shm is None


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"\x08", "varint"),  # epoch with no value
        (b"\x08" + b"\xff" * 11, "varint"),
        (b"\x00\x01", "field number 0"),
        (b"\x0b\x0c", "wire type 3"),  # a group
        (b"\x2a\x05\x0a\x01", "past the message"),  # a tensor longer than the message
        (b"\x2a\x04\x12\x05ab", "past the message"),  # a payload longer than its tensor
        (b"\x2a\x03\x0a\x05\x00", "past the message"),  # a meta longer than its tensor
        (b"\x2a\x05\x0a\x03\x0a\x01\xff", "not a Batch"),  # meta.name: not UTF-8
        (b"\x22\x02\x80\x80", "not a Batch"),  # sample_indices: a truncated packed varint
    ],
)
def test_parse_malformed_raises_value_error(raw, why):
    with pytest.raises(ValueError, match=why):
        parse_batch(raw)


def test_parse_truncated_framed_batch_raises_value_error():
    arrays, metas = arrays_and_metas()
    framed = frame_batch(HEADER, list(zip(metas, arrays, strict=True)))
    with pytest.raises(ValueError, match="past the message"):
        parse_batch(framed[:-1])


def test_keep_large_blocks_leaves_the_users_malloc_settings(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_large_blocks() is False


def test_a_chunk_parses_as_a_view_beside_its_header():
    payload = np.arange(40, dtype=np.uint8)
    head = pb.Batch(epoch=1, step=3, rank=2, chunk_total=100, chunk_offset=60)
    message = chunk_message(head, [payload[:15], payload[15:]])
    got = parse_batch(message)
    assert got.header == head and got.tensors == []
    assert isinstance(got.chunk, memoryview) and bytes(got.chunk) == payload.tobytes()
    want = pb.Batch()
    want.CopyFrom(head)
    want.chunk = payload.tobytes()
    assert pb.Batch.FromString(message) == want  # what protobuf itself reads


def test_pieces_cut_a_payload_into_runs_of_at_most_the_chunk_size():
    payload = [
        np.arange(10, dtype=np.uint8),
        np.arange(3, dtype=np.uint8),
        np.arange(7, dtype=np.uint8),
    ]
    runs = list(_pieces(payload, 6))
    assert [sum(p.nbytes for p in r) for r in runs] == [6, 6, 6, 2]
    joined = np.concatenate([np.concatenate(r) for r in runs])
    assert np.array_equal(joined, np.concatenate(payload))

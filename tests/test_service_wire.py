"""Hand-framed ``Batch`` bytes parse to exactly the message protobuf builds, and
``parse_batch`` reads any ``Batch`` exactly as ``Batch.FromString`` does, payloads as views."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from datastore.service._pb.v1 import datastore_pb2 as pb
from datastore.service.client import _Chunks
from datastore.service.stream import CHUNK_BYTES, chunk_bytes
from datastore.service.wire import (
    MAX_MESSAGE,
    ReceivedBatch,
    chunk_messages,
    frame_batch,
    keep_large_blocks,
    parse_batch,
    plan_chunks,
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
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert keep_large_blocks() is False


# A process that made the setting before starting gRPC streams 32 MiB messages over a Unix
# socket to itself; prints the minor page faults of each message received.
_STREAM_FAULTS = textwrap.dedent(
    """
    import os, resource, tempfile
    from concurrent import futures
    from datastore.service.wire import keep_large_blocks
    assert keep_large_blocks()
    import grpc
    size, count = 32 << 20, 24
    opts = [("grpc.max_send_message_length", 2 * size),
            ("grpc.max_receive_message_length", 2 * size)]
    payload = b"\\x01" * size
    method = grpc.unary_stream_rpc_method_handler(lambda request, context: iter([payload] * count))
    server = grpc.server(futures.ThreadPoolExecutor(2), options=opts)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"S": method}),))
    sock = os.path.join(tempfile.mkdtemp(), "s")
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    call = grpc.insecure_channel(f"unix://{sock}", options=opts).unary_stream("/t.T/S")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for message in call(b""):
        assert len(message) == size
        now = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        print(now - before)
        before = now
    server.stop(None)
    """
)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a setting of glibc's malloc")
def test_keep_large_blocks_lets_grpcs_threads_reuse_freed_messages():
    """gRPC's threads receive and copy each message into blocks of tens of MiB; without the
    setting (one arena) each came back as fresh zeroed pages (thousands of page faults a
    message: 25,000-28,000 over messages 4 to 24 here, 0-8,200 with it)."""
    out = subprocess.run(
        [sys.executable, "-c", _STREAM_FAULTS], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    faults = [int(line) for line in out.stdout.split()]
    assert len(faults) == 24
    pages = (32 << 20) // 4096
    assert sum(faults[3:]) < 2 * pages, faults


def test_chunk_plan_cuts_at_rows_and_splits_only_rows_larger_than_a_chunk():
    """Chunks hold whole rows (samples) of the tensors, in order, at most ``limit`` bytes each;
    only a row larger than a chunk is cut, starting in the room the previous chunk left."""
    plan = plan_chunks([(3, 40), (2, 150), (4, 8)], 100)
    assert [[tuple(p) for p in chunk] for chunk in plan] == [
        [(0, 0, 0, 40), (0, 1, 0, 40)],
        [(0, 2, 0, 40), (1, 0, 0, 60)],
        [(1, 0, 60, 150), (1, 1, 0, 10)],
        [(1, 1, 10, 110)],
        [(1, 1, 110, 150), (2, 0, 0, 8), (2, 1, 0, 8), (2, 2, 0, 8), (2, 3, 0, 8)],
    ]
    assert plan_chunks([(2, 0), (0, 8)], 100) == []  # no payload: no chunk
    with pytest.raises(ValueError, match="chunk"):
        plan_chunks([(1, 8)], 0)


def test_a_cosmoflow_batch_over_the_message_cap_is_planned_in_chunks_under_it():
    """8 CosmoFlow samples (4 x 128^3 float32, 32 MiB each) plus their labels are more than
    gRPC's 256 MiB message cap: planned (arithmetic only, nothing allocated) as messages of at
    most the default chunk size, well under the cap."""
    x_row, y_row = 4 * 128**3 * 4, 4 * 4
    total = 8 * x_row + 8 * y_row
    assert total > MAX_MESSAGE
    assert CHUNK_BYTES <= MAX_MESSAGE - (1 << 20)  # room for the header of any chunk
    plan = plan_chunks([(8, x_row), (8, y_row)], CHUNK_BYTES)
    sizes = [sum(p.stop - p.start for p in chunk) for chunk in plan]
    assert sum(sizes) == total and max(sizes) <= CHUNK_BYTES
    assert len(plan) == 5  # two samples a chunk, the labels in the last one
    assert all(p.start == 0 for chunk in plan for p in chunk)  # no sample cut in two


def test_chunk_size_from_the_environment(monkeypatch):
    monkeypatch.delenv("DATASTORE_INLINE_CHUNK", raising=False)
    assert chunk_bytes() == CHUNK_BYTES == 64 << 20
    monkeypatch.setenv("DATASTORE_INLINE_CHUNK", "5000")
    assert chunk_bytes() == 5000
    for bad in ("0", "-3", "lots", str(MAX_MESSAGE)):
        monkeypatch.setenv("DATASTORE_INLINE_CHUNK", bad)
        with pytest.raises(ValueError, match="DATASTORE_INLINE_CHUNK"):
            chunk_bytes()


@pytest.mark.parametrize("limit", [1000, 100, 7])
def test_chunked_batch_is_filled_in_place_and_reassembled_into_owned_arrays(limit):
    """The service writes each row of the batch straight into its chunk's message (rows larger
    than a chunk through a scratch row); the chunks read back, by ``parse_batch`` and by
    protobuf, as the batch's bytes in order, and the client copies them into one fresh array
    per tensor that it owns."""
    rng = np.random.default_rng(1)
    arrays = {
        "x": rng.standard_normal((3, 5, 7)).astype(np.float32),  # rows of 140 bytes
        "idx": np.array([5, 900, 2], np.int64),
        "s": rng.standard_normal((3,)).astype(np.float16),  # 0-d rows
        "e": np.zeros((3, 0), np.float64),  # empty rows
    }
    metas = [
        pb.TensorMeta(name=n, dtype=a.dtype.str, shape=list(a.shape), nbytes=a.nbytes)
        for n, a in arrays.items()
    ]
    batch = chunk_messages(
        HEADER, [(m, arrays[m.name].shape, arrays[m.name].dtype) for m in metas], limit
    )
    for name, a in arrays.items():
        for pos in range(len(a)):
            batch.out[name][pos, ...][...] = a[pos]  # as fill_batch writes a row
    batch.finish()
    payload = b"".join(a.tobytes() for a in arrays.values())
    got, offsets = [], []
    for i, message in enumerate(batch.messages):
        parsed = parse_batch(message)
        assert len(parsed.chunk) <= limit and parsed.header.chunk_total == len(payload)
        assert parsed.header.step == HEADER.step and parsed.header.epoch == HEADER.epoch
        if i == 0:
            assert list(parsed.header.sample_indices) == list(HEADER.sample_indices)
            assert parsed.header.last_in_epoch
            assert [t.meta for t in parsed.tensors] == metas
            assert all(t.data is None and t.shm is None for t in parsed.tensors)
        else:
            assert not parsed.tensors and not parsed.header.sample_indices
        assert pb.Batch.FromString(message).chunk == bytes(parsed.chunk)  # protobuf agrees
        offsets.append(parsed.header.chunk_offset)
        got.append(bytes(parsed.chunk))
    assert b"".join(got) == payload
    assert offsets == [sum(len(g) for g in got[:i]) for i in range(len(got))]
    assert batch.payload == [len(g) for g in got]
    if limit >= 140:
        assert not batch.scratch  # every row fits a chunk: no extra copy
    chunks = None
    for message in batch.messages:
        parsed = parse_batch(message)
        chunks = _Chunks(parsed) if chunks is None else chunks
        chunks.add(parsed)
    assert chunks.complete
    received = chunks.received()
    assert received.owned and received.generation is None
    assert received.header.step == HEADER.step and not received.header.tensors
    for name, a in arrays.items():
        r = received.arrays[name]
        assert r.dtype == a.dtype and r.shape == a.shape and r.tobytes() == a.tobytes()
        assert r.flags.writeable and r.flags.owndata and r.flags.c_contiguous


def test_chunks_out_of_order_are_refused():
    arrays = {"x": np.arange(40, dtype=np.uint8).reshape(4, 10)}
    meta = pb.TensorMeta(name="x", dtype="|u1", shape=[4, 10], nbytes=40)
    batch = chunk_messages(HEADER, [(meta, (4, 10), np.dtype(np.uint8))], 10)
    for pos in range(4):
        batch.out["x"][pos, ...][...] = arrays["x"][pos]
    batch.finish()
    first, second, third, _ = (parse_batch(m) for m in batch.messages)
    chunks = _Chunks(first)
    chunks.add(first)
    with pytest.raises(ValueError, match="expected"):
        chunks.add(third)
    with pytest.raises(ValueError, match="start with its header"):
        _Chunks(second)

"""A ``Batch`` message with inline tensors, framed by hand: one copy of each payload.

Building ``Tensor(data=arr.tobytes())`` inside a ``Batch`` and serializing it copies every
payload four times in Python protobuf (``tobytes``, the field, the nesting, the serialization).
Protobuf's wire format lets a message be written as the concatenation of its fields, so the
header fields are serialized by protobuf and each tensor is written as
``field 5, length, (field 1: meta, field 2: payload)`` straight from the batch slot into one
buffer. ``Batch.FromString`` of the result equals the message built the usual way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["frame_batch", "serialize"]

_LEN = 2  # wire type of length-delimited fields
BATCH_TENSORS, TENSOR_META, TENSOR_DATA = 5, 1, 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int) -> bytes:
    return _varint(field << 3 | _LEN)


def frame_batch(header: Any, tensors: list[tuple[Any, np.ndarray]]) -> bytes:
    """``header`` (a ``Batch`` without tensors) plus ``(TensorMeta, array)`` pairs, serialized
    as a ``Batch`` whose tensors carry the arrays' bytes inline (C order)."""
    parts: list[bytes | np.ndarray] = [header.SerializeToString()]
    for meta, arr in tensors:
        m = meta.SerializeToString()
        data_head = _key(TENSOR_DATA) + _varint(arr.nbytes)
        body = len(_key(TENSOR_META)) + len(_varint(len(m))) + len(m) + len(data_head) + arr.nbytes
        parts.append(_key(BATCH_TENSORS) + _varint(body) + _key(TENSOR_META) + _varint(len(m)) + m)
        parts.append(data_head)
        parts.append(arr)
    total = sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in parts)
    out = np.empty(total, np.uint8)
    at = 0
    for p in parts:
        if isinstance(p, np.ndarray):
            out[at : at + p.nbytes] = np.ascontiguousarray(p).reshape(-1).view(np.uint8)
            at += p.nbytes
        else:
            out[at : at + len(p)] = np.frombuffer(p, np.uint8)
            at += len(p)
    return out.tobytes()


def serialize(message: Any) -> bytes:
    """gRPC's response serializer for ``StreamBatches``: framed bytes as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()

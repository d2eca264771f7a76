"""``Batch`` messages with inline tensors on the wire: framed and parsed by hand, one copy each.

Building ``Tensor(data=arr.tobytes())`` inside a ``Batch`` and serializing it copies every
payload four times in Python protobuf (``tobytes``, the field, the nesting, the serialization).
Protobuf's wire format lets a message be written as the concatenation of its fields, so the
header fields are serialized by protobuf and each tensor is written as
``field 5, length, (field 1: meta, field 2: payload)`` into one fresh ``bytes`` whose payload
regions the producer fills in place (:func:`batch_message`; :func:`frame_batch` from arrays).
``Batch.FromString`` of the result equals the message built the usual way.

Parsing with ``Batch.FromString`` copies each payload into the message and again into a
``bytes`` object when ``Tensor.data`` is read. :func:`parse_batch` walks the tensors itself:
metadata and header fields are parsed by protobuf, payloads are ``memoryview`` slices of the
received ``bytes`` (no copy). It accepts any ``Batch``, framed or built by protobuf, inline or
shared-memory.

Messages of tens of MiB meet glibc's malloc, which serves blocks over its mmap threshold (at most
32 MiB) with a fresh ``mmap`` each and unmaps them on free: every message then costs a page
fault per 4 KiB page. :func:`keep_large_blocks` keeps such blocks in the heap for reuse.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from datastore.service._pb.v1 import datastore_pb2 as pb

__all__ = [
    "HEAP_KEEP_BYTES",
    "ReceivedBatch",
    "ReceivedTensor",
    "batch_message",
    "bytes_field",
    "bytes_field_view",
    "chunk_message",
    "frame_batch",
    "keep_large_blocks",
    "parse_batch",
    "serialize",
]

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5  # wire types
BATCH_TENSORS, TENSOR_META, TENSOR_DATA, TENSOR_SHM = 5, 1, 2, 3
BATCH_CHUNK = 9  # Batch.chunk: a byte range of a batch sent in several messages
HEAP_KEEP_BYTES = 1 << 30  # over the 256 MiB message limit; fits mallopt's int
HEAP_TOP_PAD = 256 << 20  # the heap grows by a message at least
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes, _new_bytes.restype = [ctypes.c_void_p, ctypes.c_ssize_t], ctypes.py_object
_BYTES_DATA = bytes.__basicsize__ - 1  # where a bytes object's contents start (CPython)


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


def bytes_field(field: int, payload: np.ndarray) -> bytes:
    """A message whose only field is the bytes field ``field`` holding ``payload`` (one copy)."""
    return b"".join((_key(field), _varint(payload.nbytes), memoryview(payload).cast("B")))


def bytes_field_view(message: bytes, field: int) -> memoryview:
    """The value of bytes field ``field`` of ``message``, a message with that field only, as a
    view (no copy); empty for an empty message.

    Raises:
        ValueError: ``message`` holds another field, or is malformed.
    """
    value = memoryview(b"")
    for number, wire, record, at, stop in _fields(message, 0, len(message)):
        if (number, wire) != (field, _LEN):
            raise ValueError(
                f"field {number} (wire type {wire}) at byte {record}: expected {field}"
            )
        value = memoryview(message)[at:stop]
    return value


def _writable(address: int, n: int, owner: Any) -> np.ndarray:
    """A writable uint8 array over ``n`` bytes at ``address``, which ``owner`` holds; the array
    keeps ``owner`` alive."""
    room = (ctypes.c_ubyte * n).from_address(address)
    room.owner = owner
    return np.ctypeslib.as_array(room)


def _fresh_bytes(n: int) -> tuple[bytes, np.ndarray]:
    """A new ``bytes`` of ``n`` bytes and a writable uint8 array over its contents, to fill
    before the ``bytes`` is handed to anyone (CPython's ``PyBytes_FromStringAndSize(NULL, n)``,
    as C code builds a ``bytes`` in place)."""
    message = _new_bytes(None, n)
    return message, _writable(id(message) + _BYTES_DATA, n, message)


def batch_message(
    header: Any, tensors: list[tuple[Any, tuple[int, ...], np.dtype]]
) -> tuple[bytes, list[np.ndarray]]:
    """A serialized ``Batch``: ``header`` (without tensors) plus one inline tensor per
    ``(TensorMeta, shape, dtype)``, whose payloads are left to fill through the returned
    arrays (C order). Filling them in place is the one copy of each payload; the message must
    not be handed on (to gRPC) before they are filled, nor the arrays used after."""
    parts: list[bytes] = [header.SerializeToString()]
    sizes = []
    for meta, shape, dtype in tensors:
        m = meta.SerializeToString()
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        data_head = _key(TENSOR_DATA) + _varint(nbytes)
        body = len(_key(TENSOR_META)) + len(_varint(len(m))) + len(m) + len(data_head) + nbytes
        parts.append(
            _key(BATCH_TENSORS)
            + _varint(body)
            + _key(TENSOR_META)
            + _varint(len(m))
            + m
            + data_head
        )
        sizes.append(nbytes)
    message, room = _fresh_bytes(sum(len(p) for p in parts) + sum(sizes))
    at, arrays = len(parts[0]), []
    room[:at] = np.frombuffer(parts[0], np.uint8)
    for part, nbytes, (_, shape, dtype) in zip(parts[1:], sizes, tensors, strict=True):
        room[at : at + len(part)] = np.frombuffer(part, np.uint8)
        at += len(part)
        arrays.append(room[at : at + nbytes].view(dtype).reshape(shape))
        at += nbytes
    return message, arrays


def frame_batch(header: Any, tensors: list[tuple[Any, np.ndarray]]) -> bytes:
    """``header`` (a ``Batch`` without tensors) plus ``(TensorMeta, array)`` pairs, serialized
    as a ``Batch`` whose tensors carry the arrays' bytes inline (C order): each array copied
    once, into the message (:func:`batch_message`)."""
    message, room = batch_message(header, [(m, a.shape, a.dtype) for m, a in tensors])
    for dst, (_, arr) in zip(room, tensors, strict=True):
        dst[...] = arr
    return message


def chunk_message(header: Any, pieces: list[np.ndarray]) -> bytes:
    """``header`` (a ``Batch`` with ``chunk_total``/``chunk_offset`` set) plus ``chunk``, the
    bytes of ``pieces`` one after the other: each byte copied once, into the message."""
    n = sum(p.nbytes for p in pieces)
    return b"".join((header.SerializeToString(), _key(BATCH_CHUNK), _varint(n), *pieces))


def serialize(message: Any) -> bytes:
    """gRPC's response serializer for ``StreamBatches``: framed bytes as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


@dataclass(frozen=True)
class ReceivedTensor:
    """One tensor of a received ``Batch``: ``data`` (inline bytes, a view of the message) or
    ``shm`` (a shared-memory region) is set, as the message's ``payload`` oneof; neither
    for a tensor with no payload."""

    meta: Any  # pb.TensorMeta
    data: memoryview | None = None
    shm: Any = None  # pb.SharedMemoryRegion


@dataclass(frozen=True)
class ReceivedBatch:
    """A received ``Batch``: ``header`` is the message without its tensors and chunk;
    ``chunk`` a view of the chunk's bytes (a batch sent in several messages)."""

    header: Any  # pb.Batch
    tensors: list[ReceivedTensor]
    chunk: memoryview | None = None


def _read_varint(buf: bytes, at: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while at < end and shift < 64:
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    raise ValueError("a truncated or over-long varint")


def _fields(buf: bytes, start: int, end: int) -> Any:
    """``(field, wire type, record start, value start, value end)`` of each field in
    ``buf[start:end]``; a length-delimited value excludes its length."""
    at = start
    while at < end:
        record = at
        key, at = _read_varint(buf, at, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ValueError(f"field number 0 at byte {record}")
        if wire == _VARINT:
            _, stop = _read_varint(buf, at, end)
        elif wire == _LEN:
            n, at = _read_varint(buf, at, end)
            stop = at + n
        elif wire in (_I64, _I32):
            stop = at + (8 if wire == _I64 else 4)
        else:
            raise ValueError(f"unsupported wire type {wire} (field {field}) at byte {record}")
        if stop > end:
            raise ValueError(f"field {field} at byte {record} runs past the message's end")
        yield field, wire, record, at, stop
        at = stop


def _tensor(buf: bytes, view: memoryview, start: int, end: int) -> ReceivedTensor:
    meta, data, shm = pb.TensorMeta(), None, None
    for field, wire, _, at, stop in _fields(buf, start, end):
        if wire != _LEN:
            continue  # a known field of the wrong type parses as an unknown one: dropped
        if field == TENSOR_META:
            meta.MergeFromString(view[at:stop])
        elif field == TENSOR_DATA:
            data, shm = view[at:stop], None
        elif field == TENSOR_SHM:
            if shm is None:
                shm, data = pb.SharedMemoryRegion(), None
            shm.MergeFromString(view[at:stop])
    return ReceivedTensor(meta, data, shm)


def parse_batch(message: bytes) -> ReceivedBatch:
    """A serialized ``Batch``, with inline payloads as views of ``message`` (no copy).

    Fields other than ``tensors`` are parsed by protobuf into ``header``; tensors follow
    protobuf's rules (``meta`` merged when repeated, the last payload wins). gRPC's response
    deserializer for ``StreamBatches`` on the client.

    Raises:
        ValueError: ``message`` is not a well-formed ``Batch``.
    """
    view = memoryview(message)
    header_parts: list[memoryview] = []
    tensors: list[ReceivedTensor] = []
    chunk = None
    try:
        for field, wire, record, at, stop in _fields(message, 0, len(message)):
            if field == BATCH_TENSORS and wire == _LEN:
                tensors.append(_tensor(message, view, at, stop))
            elif field == BATCH_CHUNK and wire == _LEN:
                chunk = view[at:stop]
            else:
                header_parts.append(view[record:stop])
        header = pb.Batch.FromString(b"".join(header_parts))
    except DecodeError as exc:
        raise ValueError(f"not a Batch message: {exc}") from exc
    return ReceivedBatch(header, tensors, chunk)


def keep_large_blocks() -> bool:
    """Make glibc's malloc serve blocks up to ``HEAP_KEEP_BYTES`` from the heap and keep up to
    as much free memory there, instead of a fresh ``mmap`` (zeroed, page-faulted) per message
    and tensor; the heap grows ``HEAP_TOP_PAD`` beyond a request at a time. Process-wide: the
    process keeps up to ``HEAP_KEEP_BYTES`` of freed memory for reuse. Left to the user when
    any of glibc's ``MALLOC_*_`` settings is in the environment.

    Returns:
        Whether the setting was made (``False`` without glibc or when left to the user).
    """
    if any(name in os.environ for name in _MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = (
        (_M_MMAP_THRESHOLD, HEAP_KEEP_BYTES),
        (_M_TRIM_THRESHOLD, HEAP_KEEP_BYTES),
        (_M_TOP_PAD, HEAP_TOP_PAD),
    )
    return all([bool(mallopt(param, value)) for param, value in settings])

"""``Batch`` messages with inline tensors on the wire: framed and parsed by hand, one copy each.

Building ``Tensor(data=arr.tobytes())`` inside a ``Batch`` and serializing it copies every
payload four times in Python protobuf (``tobytes``, the field, the nesting, the serialization).
Protobuf's wire format lets a message be written as the concatenation of its fields, so the
header fields are serialized by protobuf and each tensor is written as
``field 5, length, (field 1: meta, field 2: payload)`` into one fresh ``bytes`` whose payload
regions the producer fills in place (:func:`batch_message`; :func:`frame_batch` from arrays).
``Batch.FromString`` of the result equals the message built the usual way.

A batch too large for one message (gRPC caps a message at :data:`MAX_MESSAGE`) goes as several
``Batch`` messages, each carrying a ``chunk`` of the payload (the tensors' bytes one after the
other); :func:`plan_chunks` cuts it at sample boundaries where a sample fits a chunk, and
:func:`chunk_messages` lays the samples out straight in those messages, filled in place too.

Writing through ``ctypes`` happens only here, and only into a ``bytes`` object this process
has just created for a message it is about to send (:func:`_fresh_bytes`, what C code does with
``PyBytes_FromStringAndSize(NULL, n)``): nobody else holds it, its hash has never been taken,
and it is handed to gRPC only once filled, then never written again. That is what makes the
gather the one copy of the service's payload (gRPC takes ``bytes`` only). A message *received*
is never written: :func:`parse_batch` gives read-only views of it.

Parsing with ``Batch.FromString`` copies each payload into the message and again into a
``bytes`` object when ``Tensor.data`` is read. :func:`parse_batch` walks the tensors itself:
metadata and header fields are parsed by protobuf, payloads are ``memoryview`` slices of the
received ``bytes`` (no copy). It accepts any ``Batch``, framed or built by protobuf, inline or
shared-memory, whole or chunked.

Messages of tens of MiB meet glibc's malloc, which serves blocks over its mmap threshold (at most
32 MiB) with a fresh ``mmap`` each and unmaps them on free: every message then costs a page
fault per 4 KiB page. :func:`keep_large_blocks` keeps such blocks in the heap for reuse.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError

from datastore.service._pb.v1 import datastore_pb2 as pb

__all__ = [
    "HEAP_KEEP_BYTES",
    "MAX_MESSAGE",
    "ChunkedBatch",
    "Piece",
    "ReceivedBatch",
    "ReceivedTensor",
    "batch_message",
    "bytes_field",
    "bytes_field_view",
    "chunk_messages",
    "frame_batch",
    "keep_large_blocks",
    "parse_batch",
    "plan_chunks",
    "serialize",
]

MAX_MESSAGE = 256 << 20  # the largest message the service sends and a client receives

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5  # wire types
BATCH_TENSORS, TENSOR_META, TENSOR_DATA, TENSOR_SHM = 5, 1, 2, 3
BATCH_CHUNK = 9  # Batch.chunk: a byte range of a batch sent in several messages
HEAP_KEEP_BYTES = 1 << 30  # over the 256 MiB message limit; fits mallopt's int
HEAP_TOP_PAD = 256 << 20  # the heap grows by a message at least
_MALLOC_ENV = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
)
# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
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


def _fresh_bytes(n: int) -> tuple[bytes, np.ndarray]:
    """A new ``bytes`` of ``n`` bytes and a writable uint8 array over its contents, to fill
    before the ``bytes`` is handed to anyone (CPython's ``PyBytes_FromStringAndSize(NULL, n)``,
    as C code builds a ``bytes`` in place). The array keeps the ``bytes`` alive. Only for a
    message this process is about to send, never for one it received (module docstring)."""
    message = _new_bytes(None, n)
    room = (ctypes.c_ubyte * n).from_address(id(message) + _BYTES_DATA)
    room.owner = message
    return message, np.ctypeslib.as_array(room)


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


class Piece(NamedTuple):
    """Bytes ``start:stop`` of row (sample) ``row`` of tensor ``tensor`` of a batch."""

    tensor: int
    row: int
    start: int
    stop: int


def plan_chunks(tensors: list[tuple[int, int]], limit: int) -> list[list[Piece]]:
    """The payload of a batch whose tensors have ``(rows, bytes per row)`` cut into chunks of at
    most ``limit`` bytes, in order (tensor after tensor, row after row). A row that fits a
    chunk is never cut: it starts a new chunk when the current one has no room for it. Only a
    row larger than ``limit`` is cut, starting in whatever room the current chunk has left.

    Raises:
        ValueError: ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError(f"the chunk size must be >= 1 byte, got {limit}")
    chunks: list[list[Piece]] = []
    room = 0
    for t, (rows, size) in enumerate(tensors):
        if size <= 0:
            continue
        for r in range(rows):
            if size <= limit and size > room:
                chunks.append([])
                room = limit
            at = 0
            while at < size:
                if room == 0:
                    chunks.append([])
                    room = limit
                take = min(room, size - at)
                chunks[-1].append(Piece(t, r, at, at + take))
                at, room = at + take, room - take
    return chunks


class _Rows:
    """One tensor of a batch whose rows lie in different messages: indexed as
    :func:`datastore.store.gather.fill_batch` indexes a batch array (``rows[pos, ...]``), it gives
    row ``pos``, a writable array of the row's shape."""

    def __init__(self, rows: list[np.ndarray]) -> None:
        self._rows = rows

    def __getitem__(self, key: Any) -> np.ndarray:
        return self._rows[key[0] if isinstance(key, tuple) else key]

    def __len__(self) -> int:
        return len(self._rows)


@dataclass
class ChunkedBatch:
    """A batch laid out in several ``Batch`` messages, to fill in place (:func:`chunk_messages`).

    Attributes:
        messages: the serialized messages, in order; not to be handed on before
            :meth:`finish`.
        payload: payload bytes of each message.
        out: ``{tensor name: rows}``: where each row of the batch goes, ``out[name][pos, ...]``
            as for a batch array (``datastore.store.gather.fill_batch`` fills it): a view of its
            message, or a scratch row for a row cut across messages.
        scratch: ``(scratch row, [(message region, start, stop)])`` for each cut row:
            :meth:`finish` copies bytes ``start:stop`` of the row into each region.
    """

    messages: list[bytes]
    payload: list[int]
    out: dict[str, _Rows]
    scratch: list[tuple[np.ndarray, list[tuple[np.ndarray, int, int]]]]

    def finish(self) -> None:
        """Copy the cut rows into their messages; the batch may then be sent (and the rows are
        no longer to be written)."""
        for row, regions in self.scratch:
            flat = row.reshape(-1).view(np.uint8)
            for region, start, stop in regions:
                region[...] = flat[start:stop]
        self.out, self.scratch = {}, []


def chunk_messages(
    header: Any, tensors: list[tuple[Any, tuple[int, ...], np.dtype]], limit: int
) -> ChunkedBatch:
    """A batch of ``header`` (a ``Batch`` without tensors) plus one inline tensor per
    ``(TensorMeta, shape, dtype)`` (batch first), as ``Batch`` messages of at most ``limit``
    payload bytes each (:func:`plan_chunks`), each a fresh ``bytes`` to be filled in place
    through :attr:`ChunkedBatch.out`.

    The first message carries ``header``, the tensors' metas (no payload), ``chunk_total``
    (the payload bytes of the whole batch) and the first chunk; the others carry ``epoch``,
    ``step``, ``rank``, ``chunk_total``, ``chunk_offset`` and their chunk. A row that fits a
    chunk is a view of its message (filling it is the one copy); a row cut across messages is
    filled into a scratch row first and copied by :meth:`ChunkedBatch.finish`.
    """
    shapes = [(tuple(shape), np.dtype(dtype)) for _, shape, dtype in tensors]
    row_bytes = [math.prod(s[1:]) * d.itemsize for s, d in shapes]
    plan = plan_chunks([(s[0], n) for (s, _), n in zip(shapes, row_bytes, strict=True)], limit)
    total = sum(s[0] * n for (s, _), n in zip(shapes, row_bytes, strict=True))
    rows: list[list[Any]] = [[None] * s[0] for s, _ in shapes]  # each row's destination
    cut: dict[tuple[int, int], list[tuple[np.ndarray, int, int]]] = {}
    messages, payload, offset = [], [], 0
    for k, chunk in enumerate(plan):
        if k == 0:
            head = pb.Batch()
            head.CopyFrom(header)
            for meta, _, _ in tensors:
                head.tensors.add(meta=meta)
        else:
            head = pb.Batch(epoch=header.epoch, step=header.step, rank=header.rank)
        head.chunk_total, head.chunk_offset = total, offset
        n = sum(p.stop - p.start for p in chunk)
        prefix = head.SerializeToString() + _key(BATCH_CHUNK) + _varint(n)
        message, room = _fresh_bytes(len(prefix) + n)
        room[: len(prefix)] = np.frombuffer(prefix, np.uint8)
        at = len(prefix)
        for p in chunk:
            region = room[at : at + p.stop - p.start]
            shape, dtype = shapes[p.tensor]
            if p.stop - p.start == row_bytes[p.tensor]:  # the whole row, in this message
                rows[p.tensor][p.row] = region.view(dtype).reshape(shape[1:])
            else:
                cut.setdefault((p.tensor, p.row), []).append((region, p.start, p.stop))
            at += p.stop - p.start
        messages.append(message)
        payload.append(n)
        offset += n
    scratch = []
    for (t, r), regions in cut.items():
        shape, dtype = shapes[t]
        rows[t][r] = np.empty(shape[1:], dtype)
        scratch.append((rows[t][r], regions))
    for t, (shape, dtype) in enumerate(shapes):  # rows of no bytes: nothing to send
        for r, row in enumerate(rows[t]):
            if row is None:
                rows[t][r] = np.empty(shape[1:], dtype)
    out = {meta.name: _Rows(rows[t]) for t, (meta, _, _) in enumerate(tensors)}
    return ChunkedBatch(messages, payload, out, scratch)


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
    and tensor; the heap grows ``HEAP_TOP_PAD`` beyond a request at a time. One arena for all
    threads: gRPC's threads make the messages, and a thread's own arena is a heap of at most
    64 MiB that glibc unmaps whole once it is free, so a message of tens of MiB came back as
    fresh pages every time. Takes effect for threads that have no arena yet (glibc fixes the
    number of arenas when a thread first needs its own): call it before starting gRPC.
    Process-wide: the process keeps up to ``HEAP_KEEP_BYTES`` of freed memory for reuse. Left
    to the user when any of glibc's ``MALLOC_*`` settings is in the environment.

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
        (_M_ARENA_MAX, 1),
    )
    return all([bool(mallopt(param, value)) for param, value in settings])

"""Serializers for the two streams that carry tensor chunks, without protobuf's byte copies.

The messages are the ones in ``protos/wafl/v1/federation.proto`` and any protobuf client can
speak them. On wafl's own side a chunk is encoded by writing the small protobuf prefix and then
the raw tensor bytes in one join (one copy), and decoded by reading the protobuf wire format
directly so that ``data`` stays a zero-copy view of the received message. Runs of small chunks
(biases, norm layers) are grouped into one ``batch`` message of about 1 MiB (``group_chunks``):
per-message cost, not bytes, dominates those. Every other message goes through the generated
protobuf classes. A stock client's chunk or batch decodes identically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar, cast

import torch
from google.protobuf.message import DecodeError, Message
from wafl.common.checksum import crc32
from wafl.common.codec import CHUNK_BYTES, ChunkError, Manifest, RawChunk, TensorSpec, TransferChecker, iter_chunks
from wafl.common.proto import federation_pb2 as pb

CHUNK_FIELD = 2  # field number of `chunk` in UploadMessage and BroadcastMessage
BATCH_FIELD = 5  # field number of `batch` (a TensorChunkBatch) in both
_BATCH_CHUNKS = 1  # field number of `chunks` in TensorChunkBatch
_DATA_FIELD = 15  # field number of `data` in TensorChunk
_LEN = 2
_VARINT = 0
_I32 = 5
_I64 = 1


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    try:
        b = buf[pos]
    except IndexError:
        raise DecodeError("truncated varint") from None
    if b < 0x80:  # one byte: field keys, dtypes, most dimensions
        return b, pos + 1
    return _read_long_varint(buf, pos)


def _read_long_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise DecodeError("varint too long")


def _skip(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(buf, pos)[1]
    if wire_type == _I64:
        return pos + 8
    if wire_type == _LEN:
        n, pos = _read_varint(buf, pos)
        return pos + n
    if wire_type == _I32:
        return pos + 4
    raise DecodeError(f"unsupported wire type {wire_type}")


class ChunkBatch(tuple[RawChunk, ...]):
    """Chunks that travel in one ``TensorChunkBatch`` message, in order."""

    __slots__ = ()


def _chunk_parts(c: RawChunk) -> tuple[bytes, bytes, memoryview | bytes]:
    """``TensorChunk`` serialized as (fields before data, data key and length, data)."""
    spec = pb.TensorChunk(name=c.name, dtype=cast(pb.DType, c.dtype), shape=list(c.shape), offset=c.offset)
    head = spec.SerializeToString()
    n = len(c.data)
    return head, (_varint((_DATA_FIELD << 3) | _LEN) + _varint(n) if n else b""), c.data


def encode_chunk(c: RawChunk) -> bytes:
    """The bytes of ``{UploadMessage|BroadcastMessage}(chunk=c)``, data copied once."""
    head, data_prefix, data = _chunk_parts(c)
    outer = _varint((CHUNK_FIELD << 3) | _LEN) + _varint(len(head) + len(data_prefix) + len(data))
    return b"".join((outer, head, data_prefix, data))


def encode_batch(chunks: ChunkBatch) -> bytes:
    """The bytes of ``{UploadMessage|BroadcastMessage}(batch=TensorChunkBatch(chunks))``, one join."""
    parts: list[bytes | memoryview] = []
    for c in chunks:
        head, data_prefix, data = _chunk_parts(c)
        parts += (
            _varint((_BATCH_CHUNKS << 3) | _LEN) + _varint(len(head) + len(data_prefix) + len(data)),
            head,
            data_prefix,
            data,
        )
    inner_len = sum(len(p) for p in parts)
    return b"".join([_varint((BATCH_FIELD << 3) | _LEN) + _varint(inner_len), *parts])


def chunks_of(message: RawChunk | ChunkBatch) -> tuple[RawChunk, ...]:
    """The chunks a tensor message carries: itself, or a batch's."""
    return (message,) if isinstance(message, RawChunk) else message


def group_chunks(chunks: Iterable[RawChunk], limit: int = CHUNK_BYTES) -> Iterator[RawChunk | ChunkBatch]:
    """Consecutive chunks grouped into messages of at most ``limit`` data bytes: a chunk that
    fills a message alone travels as a ``chunk``, runs of small ones as one ``batch``."""
    group: list[RawChunk] = []
    size = 0
    for c in chunks:
        n = len(c.data)
        if group and size + n > limit:
            yield group[0] if len(group) == 1 else ChunkBatch(group)
            group, size = [], 0
        group.append(c)
        size += n
    if group:
        yield group[0] if len(group) == 1 else ChunkBatch(group)


def _decode_chunk(buf: memoryview) -> RawChunk:
    name = ""
    dtype = 0
    shape: list[int] = []
    offset = 0
    data: memoryview | bytes = b""
    pos = 0
    end = len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wt = key >> 3, key & 7
        if field == 1 and wt == _LEN:
            n, pos = _read_varint(buf, pos)
            name = bytes(buf[pos : pos + n]).decode("utf-8")
            pos += n
        elif field == 2 and wt == _VARINT:
            dtype, pos = _read_varint(buf, pos)
        elif field == 3 and wt == _LEN:  # packed
            n, pos = _read_varint(buf, pos)
            stop = pos + n
            while pos < stop:
                v, pos = _read_varint(buf, pos)
                shape.append(v - (1 << 64) if v >= 1 << 63 else v)
        elif field == 3 and wt == _VARINT:  # unpacked repeated
            v, pos = _read_varint(buf, pos)
            shape.append(v - (1 << 64) if v >= 1 << 63 else v)
        elif field == 4 and wt == _VARINT:
            offset, pos = _read_varint(buf, pos)
        elif field == _DATA_FIELD and wt == _LEN:
            n, pos = _read_varint(buf, pos)
            data = buf[pos : pos + n]
            pos += n
        else:
            pos = _skip(buf, pos, wt)
        if pos > end:
            raise DecodeError("truncated TensorChunk")
    return RawChunk(name, dtype, tuple(shape), offset, data)


M = TypeVar("M", bound=Message)


def _decode_batch(buf: memoryview) -> ChunkBatch:
    chunks: list[RawChunk] = []
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        if key != (_BATCH_CHUNKS << 3) | _LEN:
            raise DecodeError("not a plain TensorChunkBatch")  # protobuf decodes the general case
        n, pos = _read_varint(buf, pos)
        if pos + n > end:
            raise DecodeError("truncated TensorChunkBatch")
        chunks.append(_decode_chunk(buf[pos : pos + n]))
        pos += n
    return ChunkBatch(chunks)


def _decoder(cls: type[M]) -> Callable[[bytes], M | RawChunk | ChunkBatch]:
    def decode(raw: bytes) -> M | RawChunk | ChunkBatch:
        buf = memoryview(raw)
        try:
            key, pos = _read_varint(buf, 0) if len(buf) else (0, 0)
            if key in ((CHUNK_FIELD << 3) | _LEN, (BATCH_FIELD << 3) | _LEN):
                n, pos = _read_varint(buf, pos)
                if pos + n == len(buf):  # the message is exactly one chunk or batch: the fast path
                    return _decode_chunk(buf[pos:]) if key >> 3 == CHUNK_FIELD else _decode_batch(buf[pos:])
        except (DecodeError, UnicodeDecodeError):
            pass  # let protobuf produce its own error below
        msg = cls.FromString(raw)
        kind = msg.WhichOneof("kind")
        if kind == "chunk":
            return RawChunk.from_proto(msg.chunk)
        if kind == "batch":
            return ChunkBatch(RawChunk.from_proto(c) for c in msg.batch.chunks)
        return msg

    return decode


class Malformed:
    """Stands for a received message that could not be decoded; handlers refuse it (INVALID_ARGUMENT)."""

    def __repr__(self) -> str:
        return "MALFORMED"


MALFORMED = Malformed()


def lenient(decode: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """``decode``, returning :data:`MALFORMED` instead of raising on bytes it cannot decode."""

    def decode_or_mark(raw: bytes) -> object:
        try:
            return decode(raw)
        except Exception:  # any decoding failure: the handler answers with a short, fixed status
            return MALFORMED

    return decode_or_mark


class PreEncoded:
    """A message already serialized (a broadcast chunk encoded once for every subscriber)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def encode_tensors(msg: RawChunk | ChunkBatch) -> bytes:
    """A chunk or a batch as the bytes of its message."""
    return encode_chunk(msg) if isinstance(msg, RawChunk) else encode_batch(msg)


def _encoder(cls: type[M]) -> Callable[[M | RawChunk | ChunkBatch | PreEncoded], bytes]:
    def encode(msg: M | RawChunk | ChunkBatch | PreEncoded) -> bytes:
        if isinstance(msg, PreEncoded):
            return msg.data
        if isinstance(msg, (RawChunk, ChunkBatch)):
            return encode_tensors(msg)
        return msg.SerializeToString()

    return encode


decode_upload = _decoder(pb.UploadMessage)
encode_upload = _encoder(pb.UploadMessage)
decode_broadcast = _decoder(pb.BroadcastMessage)
encode_broadcast = _encoder(pb.BroadcastMessage)


# ----------------------------------------------------------------------------- one transfer, both directions
TransferMessage = type[pb.UploadMessage] | type[pb.BroadcastMessage]


def write_transfer(
    cls: TransferMessage, tensors: Iterable[tuple[str, torch.Tensor]], knowledge: Iterable[pb.ClassKnowledge] = ()
) -> Iterator[object]:
    """The messages of one model transfer after its header, in either direction: the tensors in
    manifest order as chunks and chunk batches, then the knowledge, then the trailer (CRC-32 of
    every tensor byte in order, and the number of chunks)."""
    crc = 0
    count = 0
    for message in group_chunks(iter_chunks(tensors)):
        for c in chunks_of(message):
            crc = crc32(c.data, crc)
            count += 1
        yield message
    for k in knowledge:
        yield cls(knowledge=k)
    trailer = pb.UploadTrailer if cls is pb.UploadMessage else pb.BroadcastTrailer
    yield cls(trailer=trailer(crc32=crc, num_chunks=count))


class TransferReader:
    """Reads the messages of one transfer after its header, in either direction.

    Tensor messages come first, each chunk checked against the manifest (order, name, dtype,
    shape, offsets, size), then at most ``max_knowledge`` knowledge messages, then the trailer;
    nothing may follow it. :meth:`feed` returns the checked chunks of a tensor message;
    :meth:`finish` checks completeness, the CRC-32 (computed here unless ``compute_crc`` is
    False and the caller passes its own) and the chunk count. Violations raise ``ChunkError``.
    """

    def __init__(self, manifest: Manifest, max_knowledge: int, compute_crc: bool = True) -> None:
        self.checker = TransferChecker(manifest, require_finite=False, compute_crc=compute_crc)
        self.max_knowledge = max_knowledge
        self.knowledge: list[pb.ClassKnowledge] = []
        self.trailer: pb.UploadTrailer | pb.BroadcastTrailer | None = None

    @property
    def bytes(self) -> int:
        return self.checker.bytes

    def feed(self, msg: object) -> list[tuple[TensorSpec, RawChunk]]:
        if self.trailer is not None:
            raise ChunkError("message after the trailer")
        if msg is MALFORMED:
            raise ChunkError("malformed message")
        if isinstance(msg, (RawChunk, ChunkBatch)):
            if self.knowledge:
                raise ChunkError("tensor chunk after knowledge")
            chunks = chunks_of(msg)
            if not chunks:
                raise ChunkError("empty chunk batch")
            return [(self.checker.check(c), c) for c in chunks]
        if not isinstance(msg, (pb.UploadMessage, pb.BroadcastMessage)):
            raise ChunkError(f"unexpected message type {type(msg).__name__}")
        kind = msg.WhichOneof("kind")
        if kind == "knowledge":
            if len(self.knowledge) >= self.max_knowledge:
                raise ChunkError(
                    "this run's algorithm exchanges no knowledge"
                    if self.max_knowledge == 0
                    else f"more than {self.max_knowledge} knowledge entries"
                )
            self.knowledge.append(msg.knowledge)
        elif kind == "trailer":
            self.trailer = msg.trailer
        else:
            raise ChunkError(f"unexpected {kind or 'empty'} message inside a transfer")
        return []

    def finish(self, crc: int | None = None) -> None:
        if self.trailer is None:
            raise ChunkError("the transfer ended without a trailer (stream cut off)")
        self.checker.finish(self.trailer.crc32, crc)
        if self.trailer.num_chunks and self.trailer.num_chunks != self.checker.chunks:
            raise ChunkError(f"trailer counts {self.trailer.num_chunks} chunks, {self.checker.chunks} arrived")

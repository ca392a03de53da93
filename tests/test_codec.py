"""Tensor codec and wire format: bit-exact round trips, chunking, manifest checks."""

import zlib

import numpy as np
import pytest
import torch
from wafl.common.codec import (
    ChunkError,
    RawChunk,
    TransferChecker,
    crc32_of,
    iter_chunks,
    manifest_of,
    tensor_bytes,
    tensor_from_bytes,
)
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import ChunkBatch, decode_broadcast, decode_upload, encode_upload, group_chunks


def roundtrip(
    tensors: dict[str, torch.Tensor], chunk_bytes: int = 64, require_finite: bool = True
) -> dict[str, torch.Tensor]:
    manifest = manifest_of(tensors)
    checker = TransferChecker(manifest, require_finite=require_finite)
    buffers = {s.name: bytearray(s.nbytes) for s in manifest}
    for c in iter_chunks(tensors.items(), chunk_bytes):
        wire = encode_upload(c)
        back = decode_upload(wire)
        assert isinstance(back, RawChunk)
        checker.check(back)
        buffers[back.name][back.offset : back.offset + len(back.data)] = back.data
    checker.finish(crc32_of(tensors.values()))
    return {s.name: tensor_from_bytes(buffers[s.name], s) for s in manifest}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(tensor_bytes(a)) == bytes(tensor_bytes(b))


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.float64, torch.int32, torch.uint8, torch.bool],
)
def test_roundtrip_is_bit_exact(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(7, 5, 3, generator=g) * 1000
    t = base.to(dtype) if dtype != torch.bool else base > 0
    out = roundtrip(
        {"w": t, "scalar": t.reshape(-1)[0].clone().reshape(()), "empty": t.reshape(-1)[:0].reshape(0, 3)},
        chunk_bytes=48,
    )
    assert same_bits(out["w"], t)
    assert out["scalar"].shape == () and same_bits(out["scalar"], t.reshape(-1)[0].reshape(()))
    assert out["empty"].shape == (0, 3) and out["empty"].dtype == t.dtype


def test_nan_payloads_and_negative_zero_survive() -> None:
    bits = torch.tensor([0x7FC00001, 0x7F800001, 0x80000000, 0xFF800000], dtype=torch.int64).to(torch.int32)
    t = bits.view(torch.float32)
    out = roundtrip({"x": t}, require_finite=False)
    assert torch.equal(out["x"].view(torch.int32), bits)


def test_chunks_respect_size_and_element_boundaries() -> None:
    t = torch.arange(1000, dtype=torch.float64)  # 8000 bytes
    chunks = list(iter_chunks([("t", t)], chunk_bytes=1001))  # rounds down to 1000 (125 elements)
    assert [len(c.data) for c in chunks] == [1000] * 8
    assert [c.offset for c in chunks] == list(range(0, 8000, 1000))
    assert b"".join(bytes(c.data) for c in chunks) == t.numpy().tobytes()


def test_default_chunks_are_one_mebibyte() -> None:
    t = torch.zeros(600_000)  # 2.4 MB
    sizes = [len(c.data) for c in iter_chunks([("t", t)])]
    assert sizes == [1 << 20, 1 << 20, 2_400_000 - 2 * (1 << 20)]


def test_fast_encoding_is_plain_protobuf() -> None:
    t = torch.randn(300)
    (c,) = list(iter_chunks([("layer.weight", t)]))
    msg = pb.UploadMessage.FromString(encode_upload(c))
    assert msg.WhichOneof("kind") == "chunk"
    assert msg.chunk.name == "layer.weight" and list(msg.chunk.shape) == [300] and msg.chunk.dtype == pb.FLOAT32
    assert msg.chunk.data == t.numpy().tobytes()
    # and a chunk serialized by stock protobuf decodes through the fast path to the same values
    stock = pb.BroadcastMessage(
        chunk=pb.TensorChunk(name="a", dtype=pb.INT64, shape=[2, 2], offset=16, data=b"\x01" * 16)
    ).SerializeToString()
    back = decode_broadcast(stock)
    assert isinstance(back, RawChunk)
    assert (back.name, back.dtype, back.shape, back.offset, bytes(back.data)) == (
        "a",
        pb.INT64,
        (2, 2),
        16,
        b"\x01" * 16,
    )


def _fields(c: RawChunk) -> tuple:
    return (c.name, c.dtype, tuple(c.shape), c.offset, bytes(c.data))


def test_batches_are_plain_protobuf_both_ways() -> None:
    tensors = {f"t{i}": torch.randn(i + 1) for i in range(5)} | {"e": torch.zeros(0), "n": torch.tensor(7)}
    chunks = list(iter_chunks(tensors.items(), 8))
    (batch,) = list(group_chunks(chunks, limit=1 << 20))
    assert isinstance(batch, ChunkBatch) and len(batch) == len(chunks)
    wire = encode_upload(batch)
    msg = pb.UploadMessage.FromString(wire)
    assert msg.WhichOneof("kind") == "batch"
    assert [_fields(RawChunk.from_proto(c)) for c in msg.batch.chunks] == [_fields(c) for c in chunks]
    assert (
        pb.UploadMessage(batch=pb.TensorChunkBatch(chunks=[c.to_proto() for c in chunks])).SerializeToString() == wire
    )
    back = decode_upload(wire)
    assert isinstance(back, ChunkBatch) and [_fields(c) for c in back] == [_fields(c) for c in chunks]
    # a message holding the batch field twice merges them (protobuf's rule): decoded by protobuf
    odd = wire + pb.UploadMessage(batch=pb.TensorChunkBatch()).SerializeToString()
    assert [_fields(c) for c in decode_upload(odd)] == [_fields(c) for c in chunks]


def test_grouping_keeps_order_and_the_message_size_limit() -> None:
    tensors = {"big": torch.randn(1000), **{f"small{i}": torch.randn(10) for i in range(30)}, "big2": torch.randn(300)}
    chunks = list(iter_chunks(tensors.items(), 1024))
    messages = list(group_chunks(chunks, limit=1024))
    flat = [c for m in messages for c in ((m,) if isinstance(m, RawChunk) else m)]
    assert [_fields(c) for c in flat] == [_fields(c) for c in chunks]
    assert all(sum(len(c.data) for c in m) <= 1024 for m in messages if isinstance(m, ChunkBatch))
    assert all(len(m) >= 2 for m in messages if isinstance(m, ChunkBatch))
    assert len(messages) < len(chunks)  # the 30 small tensors share messages


def test_non_chunk_messages_decode_as_protobuf() -> None:
    header = pb.UploadMessage(header=pb.UploadHeader(run_id="r", round=3, client_id="c", num_samples=5))
    out = decode_upload(header.SerializeToString())
    assert isinstance(out, pb.UploadMessage) and out.header.round == 3


@pytest.fixture
def manifest():
    return manifest_of({"a": torch.zeros(4, dtype=torch.float32), "b": torch.zeros(2, 2, dtype=torch.int64)})


def chunk(name="a", dtype=pb.FLOAT32, shape=(4,), offset=0, data=b"\x00" * 16) -> RawChunk:
    return RawChunk(name, dtype, shape, offset, data)


@pytest.mark.parametrize(
    "bad, words",
    [
        (chunk(name="zz"), "not in the manifest"),
        (chunk(dtype=pb.FLOAT16), "dtype"),
        (chunk(shape=(2, 2)), "shape"),
        (chunk(offset=4, data=b"\x00" * 12), "expected byte 0"),
        (chunk(data=b"\x00" * 6), "whole number"),
        (chunk(data=b"\x00" * 20), "tensor has 16"),
        (chunk(name="b", dtype=pb.INT64, shape=(2, 2), data=b"\x00" * 32), "missing"),
    ],
)
def test_checker_refuses_bad_chunks(manifest, bad: RawChunk, words: str) -> None:
    with pytest.raises(ChunkError, match=words):
        TransferChecker(manifest).check(bad)


def test_checker_refuses_nan_and_oversized(manifest) -> None:
    nan = np.array([0, np.nan, 0, 0], dtype=np.float32).tobytes()
    with pytest.raises(ChunkError, match="NaN"):
        TransferChecker(manifest).check(chunk(data=nan))
    with pytest.raises(ChunkError) as e:
        TransferChecker(manifest, max_chunk_bytes=8).check(chunk())
    assert e.value.code == "RESOURCE_EXHAUSTED"


def test_finish_detects_missing_tensor_and_bad_crc(manifest) -> None:
    ck = TransferChecker(manifest)
    ck.check(chunk())
    with pytest.raises(ChunkError, match="'b' is missing"):
        ck.finish(0)
    ck.check(chunk(name="b", dtype=pb.INT64, shape=(2, 2), data=b"\x00" * 32))
    good = zlib.crc32(b"\x00" * 48)
    with pytest.raises(ChunkError) as e:
        ck.finish(good ^ 1)
    assert e.value.code == "DATA_LOSS"
    ck.finish(good)


def test_fast_crc32_is_zlibs_crc32() -> None:
    from wafl.common import checksum

    data = np.random.default_rng(0).bytes(3 << 20)
    assert checksum.IMPLEMENTATION == "zlib-ng"  # the declared dependency is in use
    assert checksum.crc32(data) == zlib.crc32(data)
    view = memoryview(data)
    assert checksum.crc32(view[1000:], checksum.crc32(view[:1000])) == zlib.crc32(data)
    assert checksum.crc32(b"") == 0

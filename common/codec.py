"""Tensor <-> bytes: dtypes, manifests, ~1 MiB chunks, CRC-32, bit-exact reassembly.

Tensors travel as their raw little-endian bytes (``tensor.view(uint8)``), so a round trip is
bit-exact for every dtype, including bfloat16, NaN payloads, 0-d and empty tensors. Chunk
boundaries fall on element boundaries so that each chunk can be checked (finite values) and
folded into an aggregate on its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from wafl.common.checksum import crc32
from wafl.common.errors import Code, Refused
from wafl.common.proto import federation_pb2 as pb

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("wafl's tensor codec assumes a little-endian host")

CHUNK_BYTES = 1 << 20
"""Default chunk payload size (1 MiB)."""
MAX_CHUNK_BYTES = CHUNK_BYTES
"""A chunk whose payload is larger than this is refused."""

_TORCH_BY_WIRE: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.FLOAT64: torch.float64,
    pb.INT64: torch.int64,
    pb.INT32: torch.int32,
    pb.UINT8: torch.uint8,
    pb.BOOL: torch.bool,
}
_WIRE_BY_TORCH = {v: k for k, v in _TORCH_BY_WIRE.items()}
# numpy views used for checks and arithmetic; bfloat16 has no numpy type and is widened on demand.
_NUMPY_BY_WIRE: dict[int, np.dtype | None] = {
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT16: np.dtype("<f2"),
    pb.BFLOAT16: None,
    pb.FLOAT64: np.dtype("<f8"),
    pb.INT64: np.dtype("<i8"),
    pb.INT32: np.dtype("<i4"),
    pb.UINT8: np.dtype("u1"),
    pb.BOOL: np.dtype("?"),
}
_NUMPY_DTYPES = frozenset(t for w, t in _TORCH_BY_WIRE.items() if _NUMPY_BY_WIRE[w] is not None)  # Tensor.numpy's
FLOAT_WIRE_DTYPES = frozenset({pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16, pb.FLOAT64})


def wire_dtype(dtype: torch.dtype) -> int:
    try:
        return _WIRE_BY_TORCH[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} cannot travel on the wire; supported: {sorted(map(str, _WIRE_BY_TORCH))}"
        ) from None


def torch_dtype(wire: int) -> torch.dtype:
    try:
        return _TORCH_BY_WIRE[wire]
    except KeyError:
        raise ValueError(f"unknown wire dtype {wire}") from None


_ITEMSIZE = {w: torch.empty((), dtype=t).element_size() for w, t in _TORCH_BY_WIRE.items()}


def itemsize(wire: int) -> int:
    try:
        return _ITEMSIZE[wire]
    except KeyError:
        raise ValueError(f"unknown wire dtype {wire}") from None


def dtype_name(wire: int) -> str:
    return pb.DType.Name(wire) if wire in pb.DType.values() else str(wire)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One manifest entry: name, wire dtype, shape."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    # derived once: every chunk of every transfer is checked against them
    numel: int = field(init=False, repr=False, compare=False)
    nbytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = 1
        for d in self.shape:
            n *= d
        object.__setattr__(self, "numel", n)
        object.__setattr__(self, "nbytes", n * itemsize(self.dtype))

    def to_proto(self) -> pb.TensorSpec:
        return pb.TensorSpec(name=self.name, dtype=cast(pb.DType, self.dtype), shape=list(self.shape))

    @staticmethod
    def from_proto(msg: pb.TensorSpec) -> TensorSpec:
        return TensorSpec(msg.name, msg.dtype, tuple(msg.shape))


Manifest = tuple[TensorSpec, ...]


def manifest_of(tensors: Mapping[str, torch.Tensor]) -> Manifest:
    """The manifest of an ordered name -> tensor mapping (e.g. a ``state_dict``)."""
    return tuple(TensorSpec(k, wire_dtype(v.dtype), tuple(v.shape)) for k, v in tensors.items())


@dataclass(slots=True)
class RawChunk:
    """A tensor chunk as it travels; ``data`` may be a zero-copy view of the received message."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    data: memoryview | bytes

    def to_proto(self) -> pb.TensorChunk:
        return pb.TensorChunk(
            name=self.name,
            dtype=cast(pb.DType, self.dtype),
            shape=list(self.shape),
            offset=self.offset,
            data=bytes(self.data),
        )

    @staticmethod
    def from_proto(msg: pb.TensorChunk) -> RawChunk:
        return RawChunk(msg.name, msg.dtype, tuple(msg.shape), msg.offset, msg.data)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor, without copying when it is already contiguous.

    A contiguous CPU tensor that numpy can hold and that needs no gradient (every tensor of an upload
    or a broadcast) goes through ``Tensor.numpy`` alone: each ATen call (``detach``, ``reshape``,
    ``view``) releases Python's GIL and waits to take it back, which an event loop sharing its process
    with busy threads pays for every tensor it sends."""
    if t.device.type == "cpu" and not t.requires_grad and t.dtype in _NUMPY_DTYPES and t.is_contiguous():
        a = t.numpy()
        return memoryview(a.reshape(-1).view(np.uint8).data) if a.size else memoryview(b"")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy().data).cast("B")


def tensor_from_bytes(buf: bytes | bytearray | memoryview, spec: TensorSpec) -> torch.Tensor:
    """A new tensor (owning its memory) from raw bytes; raises ``ValueError`` on a size mismatch."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes != spec.nbytes:
        raise ValueError(
            f"tensor {spec.name!r}: {mv.nbytes} bytes for shape {spec.shape} {dtype_name(spec.dtype)} "
            f"({spec.nbytes} expected)"
        )
    dt = torch_dtype(spec.dtype)
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=dt)
    owned = buf if isinstance(buf, bytearray) else bytearray(mv)
    flat = torch.frombuffer(owned, dtype=torch.uint8)
    return flat.view(dt).reshape(spec.shape)


def iter_chunks(tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int = CHUNK_BYTES) -> Iterator[RawChunk]:
    """Splits tensors into chunks of at most ``chunk_bytes`` (rounded down to whole elements).

    An empty tensor still yields one chunk with no data so that the receiver sees every name.
    """
    for name, t in tensors:
        wire = wire_dtype(t.dtype)
        size = t.element_size()
        step = max(size, chunk_bytes - chunk_bytes % size)
        data = tensor_bytes(t)
        shape = tuple(t.shape)
        if data.nbytes == 0:
            yield RawChunk(name, wire, shape, 0, b"")
            continue
        for off in range(0, data.nbytes, step):
            yield RawChunk(name, wire, shape, off, data[off : off + step])


def crc32_of(tensors: Iterable[torch.Tensor]) -> int:
    """CRC-32 over the raw bytes of the tensors, in order (what a trailer carries)."""
    crc = 0
    for t in tensors:
        crc = crc32(tensor_bytes(t), crc)
    return crc


def numpy_view(data: memoryview | bytes, wire: int) -> np.ndarray:
    """The chunk's elements as a numpy array (float32 for bfloat16), zero-copy where possible."""
    np_dtype = _NUMPY_BY_WIRE[wire]
    if np_dtype is None:  # bfloat16: the high half of a float32
        raw = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return raw.view(np.float32)
    return np.frombuffer(data, dtype=np_dtype)


class ChunkError(Refused):
    """A chunk or a transfer violates the manifest (``INVALID_ARGUMENT`` unless ``code`` says otherwise)."""


class TransferChecker:
    """Checks a stream of chunks against a manifest: order, names, dtypes, shapes, sizes, values.

    Tensors must arrive in manifest order, each as consecutive chunks from offset 0. ``check``
    returns the spec of the chunk's tensor; ``finish`` verifies completeness and the trailer CRC.
    """

    def __init__(
        self,
        manifest: Manifest,
        max_chunk_bytes: int = MAX_CHUNK_BYTES,
        require_finite: bool = True,
        compute_crc: bool = True,
    ) -> None:
        self.manifest = manifest
        self.compute_crc = (
            compute_crc  # False: the caller keeps the running CRC (off the event loop) and passes it to finish
        )
        self.by_name = {s.name: i for i, s in enumerate(manifest)}
        self.max_chunk_bytes = max_chunk_bytes
        self.require_finite = require_finite
        self.index = 0  # tensor expected next
        self.offset = 0  # byte offset expected next within it
        self.crc = 0
        self.bytes = 0
        self.chunks = 0
        self._seen_current = False

    def check(self, c: RawChunk) -> TensorSpec:
        if c.name not in self.by_name:
            raise ChunkError(f"tensor {c.name!r} is not in the manifest")
        n = len(c.data)
        if n > self.max_chunk_bytes:
            raise ChunkError(
                f"chunk of tensor {c.name!r} has {n} bytes, more than the {self.max_chunk_bytes} allowed",
                Code.RESOURCE_EXHAUSTED,
            )
        i = self.by_name[c.name]
        spec = self.manifest[i]
        if c.dtype != spec.dtype:
            raise ChunkError(f"tensor {c.name!r}: dtype {dtype_name(c.dtype)}, manifest says {dtype_name(spec.dtype)}")
        if tuple(c.shape) != spec.shape:
            raise ChunkError(f"tensor {c.name!r}: shape {list(c.shape)}, manifest says {list(spec.shape)}")
        if i > self.index and self._current_complete():
            self._advance()
        if i != self.index:
            expected = (
                self.manifest[self.index].name if self.index < len(self.manifest) else "(none: all tensors received)"
            )
            what = "missing" if i > self.index else "repeated or out of order"
            raise ChunkError(f"tensor {c.name!r} arrived where {expected!r} was expected ({what})")
        if c.offset != self.offset:
            raise ChunkError(f"tensor {c.name!r}: chunk at byte {c.offset}, expected byte {self.offset}")
        size = itemsize(spec.dtype)
        if n % size:
            raise ChunkError(f"tensor {c.name!r}: chunk of {n} bytes is not a whole number of {size}-byte elements")
        if c.offset + n > spec.nbytes:
            raise ChunkError(f"tensor {c.name!r}: chunk ends at byte {c.offset + n}, tensor has {spec.nbytes}")
        if n == 0 and spec.nbytes != 0:
            raise ChunkError(f"tensor {c.name!r}: empty chunk for a non-empty tensor")
        if self.require_finite and spec.dtype in FLOAT_WIRE_DTYPES and n:
            values = numpy_view(c.data, spec.dtype)
            if not np.isfinite(values).all():
                bad = "NaN" if np.isnan(values).any() else "Inf"
                raise ChunkError(f"tensor {c.name!r}: {bad} value in chunk at byte {c.offset}")
        self.offset += n
        self._seen_current = True
        if self.compute_crc:
            self.crc = crc32(c.data, self.crc)
        self.bytes += n
        self.chunks += 1
        return spec

    def _current_complete(self) -> bool:
        return (
            self.index < len(self.manifest) and self._seen_current and self.offset == self.manifest[self.index].nbytes
        )

    def _advance(self) -> None:
        self.index += 1
        self.offset = 0
        self._seen_current = False

    def finish(self, trailer_crc: int, crc: int | None = None) -> None:
        """Checks completeness and ``trailer_crc`` against the CRC of the data (``crc`` when the
        caller computed it)."""
        if crc is not None:
            self.crc = crc
        if self._current_complete():
            self._advance()
        if self.index < len(self.manifest):
            spec = self.manifest[self.index]
            raise ChunkError(f"tensor {spec.name!r} is missing or incomplete ({self.offset} of {spec.nbytes} bytes)")
        if trailer_crc != self.crc:
            raise ChunkError(
                f"transfer CRC-32 {trailer_crc:#010x} does not match the data received ({self.crc:#010x})",
                Code.DATA_LOSS,
            )

"""A client's gRPC session: join, the broadcast stream, uploads and reports, with reconnects.

Transient failures (the server restarting, a dropped connection) are retried with
exponential backoff and full jitter; the session re-joins and re-subscribes by itself, and an
upload is retried under the same idempotency key so that a retry of an accepted upload is
answered as a success.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
import torch
from wafl.common.algorithms.hyperknowledge import ClassKnowledge
from wafl.common.checksum import crc32
from wafl.common.codec import ChunkError, Manifest, RawChunk, TensorSpec, TransferChecker, iter_chunks
from wafl.common.proto import federation_pb2 as pb
from wafl.common.tls import ClientTls
from wafl.common.tls import channel as tls_channel
from wafl.common.wire import ChunkBatch, chunks_of, decode_broadcast, encode_upload, group_chunks

PROTOCOL_VERSION = 1
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
}
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", (1 << 20) + (64 << 10)),
    ("grpc.max_send_message_length", (1 << 20) + (64 << 10)),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
]
log = structlog.get_logger("client")


@dataclass
class Backoff:
    """Exponential backoff with full jitter; ``deadline_s`` bounds the total time spent retrying."""

    base_s: float = 0.2
    cap_s: float = 5.0
    deadline_s: float = 120.0
    attempt: int = 0
    waited: float = 0.0

    async def wait(self, reason: str) -> None:
        if self.waited >= self.deadline_s:
            raise ConnectionError(f"gave up after {self.waited:.0f}s of retries: {reason}")
        delay = random.uniform(0, min(self.cap_s, self.base_s * 2**self.attempt))
        self.attempt += 1
        self.waited += delay
        log.info("retry", reason=reason, attempt=self.attempt, delay_s=round(delay, 3))
        await asyncio.sleep(delay)

    def reset(self) -> None:
        self.attempt = 0
        self.waited = 0.0


@dataclass
class ReceivedModel:
    round: int
    selected: set[str]
    final: bool
    state: dict[str, torch.Tensor]
    knowledge: dict[int, ClassKnowledge]
    server_state: dict[str, Any]
    nbytes: int = 0


@dataclass
class Session:
    address: str
    client_id: str
    client_index: int
    num_samples: int
    label_histogram: list[int]
    device: str = "cpu"
    token: str = ""
    reconnect_s: float = 120.0
    run_id: str = ""
    join_reply: pb.JoinReply | None = None
    manifest: Manifest = ()
    headers_seen: int = 0  # broadcast headers received (a broadcast is in flight when this runs ahead)
    tls: ClientTls | None = None  # None: plaintext
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)

    def _open(self) -> None:
        if self._channel is None:
            self._channel = tls_channel(self.address, self.tls, CHANNEL_OPTIONS)
            ch = self._channel
            self._join = ch.unary_unary(
                "/wafl.v1.Federation/Join",
                request_serializer=pb.JoinRequest.SerializeToString,
                response_deserializer=pb.JoinReply.FromString,
            )
            self._broadcasts = ch.unary_stream(
                "/wafl.v1.Federation/Broadcasts",
                request_serializer=pb.BroadcastRequest.SerializeToString,
                response_deserializer=decode_broadcast,
            )
            self._upload = ch.stream_unary(
                "/wafl.v1.Federation/Upload",
                request_serializer=encode_upload,
                response_deserializer=pb.UploadReply.FromString,
            )
            self._report = ch.unary_unary(
                "/wafl.v1.Federation/Report",
                request_serializer=pb.ReportRequest.SerializeToString,
                response_deserializer=pb.ReportReply.FromString,
            )

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def join(self) -> pb.JoinReply:
        self._open()
        backoff = Backoff(deadline_s=self.reconnect_s)
        req = pb.JoinRequest(
            client_id=self.client_id,
            token=self.token,
            protocol_version=PROTOCOL_VERSION,
            client_index=self.client_index,
            num_samples=self.num_samples,
            label_histogram=self.label_histogram,
            device=self.device,
        )
        while True:
            try:
                reply = await self._join(req, timeout=10.0, wait_for_ready=True)
                break
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                await backoff.wait(f"join: {e.code().name}")
        if self.run_id and reply.run_id != self.run_id:
            log.warning("run.changed", old=self.run_id, new=reply.run_id)
        self.run_id = reply.run_id
        self.join_reply = reply
        self.manifest = tuple(TensorSpec.from_proto(s) for s in reply.manifest)
        log.info("joined", run_id=reply.run_id, round=reply.round, algorithm=reply.algorithm)
        return reply

    async def models(self) -> AsyncIterator[ReceivedModel]:
        """Every broadcast as a complete model, until the final one; reconnects as needed."""
        self._open()
        backoff = Backoff(deadline_s=self.reconnect_s)
        while True:
            try:
                call = self._broadcasts(pb.BroadcastRequest(run_id=self.run_id, client_id=self.client_id))
                assembler: _Assembler | None = None
                async for msg in call:
                    if isinstance(msg, (RawChunk, ChunkBatch)):
                        if assembler is None:
                            raise ChunkError("chunk before a broadcast header")
                        for c in chunks_of(msg):
                            assembler.add(c)
                        continue
                    kind = msg.WhichOneof("kind")
                    if kind == "header":
                        self.headers_seen += 1
                        assembler = _Assembler(self.manifest, msg.header)
                    elif kind == "knowledge" and assembler is not None:
                        assembler.knowledge.append(msg.knowledge)
                    elif kind == "trailer" and assembler is not None:
                        model = assembler.finish(msg.trailer.crc32)
                        backoff.reset()
                        yield model
                        if model.final:
                            return
                        assembler = None
                log.warning("broadcasts.ended_early")
                await backoff.wait("broadcast stream ended")
            except grpc.aio.AioRpcError as e:
                if (
                    e.code() == grpc.StatusCode.NOT_FOUND
                    or e.code() in RETRYABLE
                    or e.code() == grpc.StatusCode.FAILED_PRECONDITION
                ):
                    await backoff.wait(f"broadcasts: {e.code().name}")
                    await self.join()
                    continue
                raise

    async def upload(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        num_samples: int,
        metrics: Mapping[str, float],
        knowledge: Mapping[int, ClassKnowledge] | None = None,
    ) -> int:
        """Streams one update; returns the bytes the server acknowledged (0 if it refused it)."""
        key = uuid.uuid4().hex
        backoff = Backoff(deadline_s=self.reconnect_s)
        while True:
            try:
                reply = await self._upload(self._upload_messages(round, state, num_samples, metrics, knowledge, key))
                return int(reply.bytes_received)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return 0
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED):
                    log.warning("upload.refused", round=round, code=e.code().name, details=e.details())
                    return 0
                if e.code() not in RETRYABLE:
                    raise
                await backoff.wait(f"upload: {e.code().name}")

    async def _upload_messages(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        num_samples: int,
        metrics: Mapping[str, float],
        knowledge: Mapping[int, ClassKnowledge] | None,
        key: str,
    ) -> AsyncIterator[object]:
        yield pb.UploadMessage(
            header=pb.UploadHeader(
                run_id=self.run_id,
                round=round,
                client_id=self.client_id,
                num_samples=num_samples,
                idempotency_key=key,
                metrics=dict(metrics),
            )
        )
        crc = 0
        n = 0
        for message in group_chunks(iter_chunks(state.items())):
            for chunk in chunks_of(message):
                crc = crc32(chunk.data, crc)
                n += 1
            yield message
        for k in sorted((knowledge or {}).values(), key=lambda k: k.class_id):
            yield pb.UploadMessage(
                knowledge=pb.ClassKnowledge(
                    class_id=k.class_id, count=k.count, representation=k.rep.tolist(), soft_prediction=k.soft.tolist()
                )
            )
        yield pb.UploadMessage(trailer=pb.UploadTrailer(crc32=crc, num_chunks=n))

    async def report(
        self, round: int, metrics: Mapping[str, float], timeline: list[Any] | None = None, start_unix: float = 0.0
    ) -> None:
        req = pb.ReportRequest(
            run_id=self.run_id,
            client_id=self.client_id,
            round=round,
            metrics=dict(metrics),
            timeline=[
                pb.PhaseEvent(phase=e.phase, round=e.round, start_s=e.start_s, end_s=e.end_s) for e in (timeline or [])
            ],
            client_start_unix=start_unix,
        )
        backoff = Backoff(deadline_s=min(30.0, self.reconnect_s))
        while True:
            try:
                await self._report(req, timeout=10.0)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    log.warning("report.refused", code=e.code().name, details=e.details())
                    return
                try:
                    await backoff.wait(f"report: {e.code().name}")
                except ConnectionError:
                    log.warning("report.lost", round=round)
                    return


class _Assembler:
    """Rebuilds a broadcast model from its chunks, checked against the manifest and the CRC."""

    def __init__(self, manifest: Manifest, header: pb.BroadcastHeader) -> None:
        self.header = header
        self.checker = TransferChecker(manifest, require_finite=False)
        self.buffers = {s.name: bytearray(s.nbytes) for s in manifest}
        self.knowledge: list[pb.ClassKnowledge] = []

    def add(self, c: RawChunk) -> None:
        self.checker.check(c)
        n = len(c.data)
        self.buffers[c.name][c.offset : c.offset + n] = c.data

    def finish(self, crc: int) -> ReceivedModel:
        import json

        from wafl.common.codec import tensor_from_bytes

        self.checker.finish(crc)
        state = {s.name: tensor_from_bytes(self.buffers[s.name], s) for s in self.checker.manifest}
        know = {
            k.class_id: ClassKnowledge(
                k.class_id,
                k.count,
                torch.tensor(list(k.representation), dtype=torch.float32),
                torch.tensor(list(k.soft_prediction), dtype=torch.float32),
            )
            for k in self.knowledge
        }
        h = self.header
        return ReceivedModel(
            h.round, set(h.selected), h.final, state, know, json.loads(h.server_state_json or "{}"), self.checker.bytes
        )

"""A client's gRPC session: join, the broadcast stream, uploads and reports, with reconnects.

Transient failures (the server restarting, a dropped connection) are retried with
exponential backoff and full jitter; the session re-joins and re-subscribes by itself, and an
upload is retried under the same idempotency key so that a retry of an accepted upload is
answered as a success.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
import torch
from wafl.client.reception import SharedBuffers, SharedReception
from wafl.common.codec import ChunkError, Manifest, TensorSpec, tensor_from_bytes
from wafl.common.contract import CREDENTIAL_KEY, PROTOCOL_VERSION
from wafl.common.knowledge import Knowledge, from_proto, to_proto
from wafl.common.proto import federation_pb2 as pb
from wafl.common.tls import ClientTls
from wafl.common.tls import channel as tls_channel
from wafl.common.wire import TransferReader, decode_broadcast, encode_upload, write_transfer

RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
}
CHANNEL_OPTIONS: list[tuple[str, object]] = [
    ("grpc.max_receive_message_length", (1 << 20) + (64 << 10)),
    ("grpc.max_send_message_length", (1 << 20) + (64 << 10)),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
    # A connection of its own per session, as for a client alone in its process: without it the
    # sessions of one worker (wafl worker) share one TCP connection, whose streams the server limits.
    ("grpc.use_local_subchannel_pool", 1),
]
log = structlog.get_logger("client")


def _held_by_former_session(e: grpc.aio.AioRpcError) -> bool:
    """A Join refused for a while: the index's previous session (this client before a restart, or before its
    reply was lost) still counts as live, and the server takes the token once it has been gone a few seconds;
    or this address made too many Joins with a bad secret (another process behind it), which passes too."""
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # too many bad secrets from this address (not ours)
        return True
    return e.code() == grpc.StatusCode.PERMISSION_DENIED and "session is live" in (e.details() or "")


@dataclass
class Backoff:
    """Exponential backoff with full jitter; ``deadline_s`` bounds the time since the first failure
    (the attempts' own time included), after which :meth:`wait` raises ``ConnectionError``."""

    base_s: float = 0.2
    cap_s: float = 5.0
    deadline_s: float = 120.0
    attempt: int = 0
    waited: float = 0.0
    since: float | None = None  # monotonic time of the first failure

    async def wait(self, reason: str) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if now - self.since >= self.deadline_s:
            raise ConnectionError(f"gave up after {now - self.since:.0f} s of retries: {reason}")
        delay = random.uniform(0, min(self.cap_s, self.base_s * 2**self.attempt))
        self.attempt += 1
        self.waited += delay
        log.info("retry", reason=reason, attempt=self.attempt, delay_s=round(delay, 3))
        await asyncio.sleep(delay)

    def attempt_timeout(self, longest_s: float, shortest_s: float = 0.5) -> float:
        """A timeout for the next attempt that does not outlast ``deadline_s`` (counted from now if nothing failed)."""
        if self.since is None:
            self.since = time.monotonic()
        left = self.deadline_s - (time.monotonic() - self.since)
        return min(longest_s, max(shortest_s, left))

    def reset(self) -> None:
        self.attempt = 0
        self.waited = 0.0
        self.since = None


@dataclass
class ReceivedModel:
    round: int  # its version (the header's ``round``; sync: the round it opens); rounds + 1 for the final model
    train: bool  # this client is asked to train on it
    final: bool
    state: dict[str, torch.Tensor]
    knowledge: Knowledge
    nbytes: int = 0
    adapt: bool = False  # a new client (new_clients) is asked to adapt it and report its accuracy
    upload_delta: bool = False  # an upload trained on it is the difference to it (else the trained model)
    asynchronous: bool = False  # the run's rule is not lock-step: every model trained is evaluated locally


def credential_path(state_dir: Path | None, index: int) -> Path | None:
    """Where a client with a state folder keeps its session credential (beside its ``client-<index>.pt``)."""
    return None if state_dir is None else Path(state_dir) / f"client-{index}.credential"


@dataclass
class Session:
    address: str
    client_id: str
    client_index: int
    num_samples: int
    device: str = "cpu"
    token: str = ""
    reconnect_s: float = 120.0
    run_id: str = ""
    join_reply: pb.JoinReply | None = None
    manifest: Manifest = ()
    tls: ClientTls | None = None  # None: plaintext
    credential: str = ""  # the session credential of the last Join (sent with every later call)
    # Keeps the credential across restarts of the process (in the state folder): a restarted client
    # re-joins its index with it, as a reconnecting one does, instead of being refused as a second claimant.
    credential_file: Path | None = None
    on_header: Callable[[], None] | None = None  # called as each broadcast's header arrives
    reception: SharedReception | None = None  # shared with the other clients of a worker (one buffer per broadcast)
    _channel: grpc.aio.Channel | None = field(default=None, repr=False)
    joins: int = field(default=0, repr=False)  # Joins completed so far (a rejoin after one of them is not needed)
    # one rejoin at a time: the broadcast stream and an upload that both find the server lost this
    # session (a restart, a resume) join once between them, not twice
    _rejoining: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

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
        if not self.credential and self.credential_file is not None and self.credential_file.is_file():
            self.credential = self.credential_file.read_text().strip()
        backoff = Backoff(deadline_s=self.reconnect_s)
        req = pb.JoinRequest(
            client_id=self.client_id,
            token=self.token,
            protocol_version=PROTOCOL_VERSION,
            client_index=self.client_index,
            num_samples=self.num_samples,
            device=self.device,
        )
        while True:
            try:
                timeout = backoff.attempt_timeout(10.0)  # --reconnect-s bounds the first attempt too
                reply = await self._join(req, timeout=timeout, wait_for_ready=True, metadata=self._metadata())
                break
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE and not _held_by_former_session(e):  # one line, not a traceback
                    raise ConnectionError(f"the server refused the join ({e.code().name}): {e.details()}") from None
                try:
                    await backoff.wait(f"join: {e.code().name}")
                except ConnectionError as gave_up:
                    if _held_by_former_session(e):
                        raise ConnectionError(f"{gave_up}: {e.details()}") from None
                    raise ConnectionError(f"{gave_up}{await self._why_unreachable(req)}") from None
        if self.run_id and reply.run_id != self.run_id:
            log.warning("run.changed", old=self.run_id, new=reply.run_id)
        self.run_id = reply.run_id
        if reply.session_credential:
            self.credential = reply.session_credential
            if self.credential_file is not None:
                self._keep_credential(self.credential_file)
        self.join_reply = reply
        self.manifest = tuple(TensorSpec.from_proto(s) for s in reply.manifest)
        self.joins += 1
        log.info("joined", run_id=reply.run_id, round=reply.round, algorithm=reply.algorithm)
        return reply

    async def rejoin(self, seen: int) -> None:
        """Joins again unless a Join completed since ``seen`` (:attr:`joins` when the call that found the
        session gone began): the broadcast stream and an upload each rejoin through here, one at a time,
        so that the one that comes second finds the session already back and only retries its call."""
        async with self._rejoining:
            if self.joins == seen:
                await self.join()

    def _keep_credential(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.credential)
        tmp.replace(path)

    async def _why_unreachable(self, req: pb.JoinRequest) -> str:
        """Why the server cannot be reached (a name that does not resolve, a refused connection), from one
        Join that fails fast instead of waiting for the channel; it asks for the configuration only, so
        a server that answers now registers nothing."""
        probe = pb.JoinRequest()
        probe.CopyFrom(req)
        probe.num_samples = 0
        try:
            await self._join(probe, timeout=5.0, wait_for_ready=False, metadata=self._metadata())
        except grpc.aio.AioRpcError as e:
            return f" ({e.code().name}: {(e.details() or '')[:300]})" if e.code() == grpc.StatusCode.UNAVAILABLE else ""
        return ""

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((CREDENTIAL_KEY, self.credential),) if self.credential else ()

    async def models(self) -> AsyncIterator[ReceivedModel]:
        """Every broadcast as a complete model, until the final one; reconnects as needed. A stream the server
        ends with ``ABORTED`` (it aborted the run) raises ``ConnectionError`` with the server's reason."""
        self._open()
        backoff = Backoff(deadline_s=self.reconnect_s)
        while True:
            seen = self.joins
            try:
                call = self._broadcasts(
                    pb.BroadcastRequest(run_id=self.run_id, client_id=self.client_id), metadata=self._metadata()
                )
                assembler = ModelAssembler(self.manifest, self.on_header, self.reception)
                async for msg in call:
                    model = assembler.feed(msg)
                    if model is not None:
                        backoff.reset()
                        yield model
                        if model.final:
                            return
                log.warning("broadcasts.ended_early")
                await backoff.wait("broadcast stream ended")
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.ABORTED:  # the server ended the run before its end, and says why
                    raise ConnectionError(f"the server ended the run: {e.details()}") from None
                if e.code() in RETRYABLE or e.code() in (
                    grpc.StatusCode.NOT_FOUND,  # a restarted server: join again
                    grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.UNAUTHENTICATED,  # a new run in its place: join it with the token
                ):
                    await backoff.wait(f"broadcasts: {e.code().name}")
                    await self.rejoin(seen)
                    continue
                raise

    async def upload(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        num_samples: int,
        metrics: Mapping[str, float],
        knowledge: Knowledge | None = None,
    ) -> int:
        """Streams one update; returns the bytes the server acknowledged (0 if it refused it).

        A server that no longer knows this client (``NOT_FOUND``: it restarted, or resumed from its
        checkpoint, since the client joined) is joined again (:meth:`rejoin`, shared with the broadcast
        stream) and the upload retried under the same key; a refusal that retrying cannot mend raises
        ``ConnectionError`` with one line."""
        key = uuid.uuid4().hex
        backoff = Backoff(deadline_s=self.reconnect_s)
        while True:
            seen = self.joins
            try:
                header = upload_header(self.run_id, round, self.client_id, num_samples, key, metrics)
                reply = await self._upload(upload_messages(header, state, knowledge), metadata=self._metadata())
                return int(reply.bytes_received)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                    return 0
                if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED):
                    log.warning("upload.refused", round=round, code=e.code().name, details=e.details())
                    return 0
                if e.code() == grpc.StatusCode.NOT_FOUND:  # the server lost this session: join, then retry
                    await backoff.wait(f"upload: {e.code().name} {e.details()}")
                    await self.rejoin(seen)
                    continue
                if e.code() not in RETRYABLE:
                    raise ConnectionError(
                        f"the server refused the upload for round {round} ({e.code().name}): {e.details()}"
                    ) from None
                await backoff.wait(f"upload: {e.code().name} {e.details()}")

    async def report(
        self, round: int, metrics: Mapping[str, float], timeline: list[Any] | None = None, start_unix: float = 0.0
    ) -> None:
        req = report_request(self.run_id, self.client_id, round, metrics, timeline, start_unix)
        backoff = Backoff(deadline_s=min(30.0, self.reconnect_s))
        while True:
            try:
                await self._report(req, timeout=10.0, metadata=self._metadata())
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


def upload_header(
    run_id: str, round: int, client_id: str, num_samples: int, key: str, metrics: Mapping[str, float]
) -> pb.UploadHeader:
    return pb.UploadHeader(
        run_id=run_id,
        round=round,
        client_id=client_id,
        num_samples=num_samples,
        idempotency_key=key,
        metrics=dict(metrics),
    )


async def upload_messages(
    header: pb.UploadHeader, state: Mapping[str, torch.Tensor], knowledge: Knowledge | None
) -> AsyncIterator[object]:
    """One upload's messages: the header, then the transfer (:func:`~wafl.common.wire.write_transfer`)."""
    yield pb.UploadMessage(header=header)
    for m in write_transfer(pb.UploadMessage, state.items(), to_proto(knowledge or {})):
        yield m


def report_request(
    run_id: str,
    client_id: str,
    round: int,
    metrics: Mapping[str, float],
    timeline: list[Any] | None = None,
    start_unix: float = 0.0,
) -> pb.ReportRequest:
    return pb.ReportRequest(
        run_id=run_id,
        client_id=client_id,
        round=round,
        metrics=dict(metrics),
        timeline=[
            pb.PhaseEvent(phase=e.phase, round=e.round, start_s=e.start_s, end_s=e.end_s) for e in timeline or []
        ],
        client_start_unix=start_unix,
    )


class ModelAssembler:
    """Rebuilds the models of a broadcast stream (header, transfer) with the shared
    :class:`~wafl.common.wire.TransferReader`; :meth:`feed` returns a model once its trailer passed
    and calls ``on_header`` as a header arrives (the wait-free PM yields the client's CPU to the download)."""

    def __init__(
        self,
        manifest: Manifest,
        on_header: Callable[[], None] | None = None,
        reception: SharedReception | None = None,
    ) -> None:
        self.manifest = manifest
        self.on_header = on_header
        self.reception = reception  # a worker's: the broadcasts its clients receive alike share one buffer
        self.header: pb.BroadcastHeader | None = None
        self.reader: TransferReader | None = None
        self.shared: SharedBuffers | None = None
        self.buffers: dict[str, bytearray] = {}

    def feed(self, msg: object) -> ReceivedModel | None:
        if isinstance(msg, pb.BroadcastMessage) and msg.WhichOneof("kind") == "header":
            self.header = msg.header
            self.reader = TransferReader(self.manifest, max_knowledge=1 << 16)
            if self.reception is not None:
                self.shared = self.reception.buffers((msg.header.round, msg.header.final), self.manifest)
            else:
                self.buffers = {s.name: bytearray(s.nbytes) for s in self.manifest}
            if self.on_header is not None:
                self.on_header()
            return None
        if self.reader is None or self.header is None:
            raise ChunkError("broadcast message before a header")
        for _, c in self.reader.feed(msg):
            if self.shared is not None and self.reception is not None:
                if self.shared.take(c.name, c.offset, c.data):
                    continue
                self.buffers = self.reception.leave(self.shared)  # this stream differs: on alone from here
                self.shared = None
            self.buffers[c.name][c.offset : c.offset + len(c.data)] = c.data
        if self.reader.trailer is None:
            return None
        self.reader.finish()
        if self.shared is not None:
            state = self.shared.decode()
            knowledge = self.shared.knowledge(self.reader.knowledge)
        else:
            state = {s.name: tensor_from_bytes(self.buffers[s.name], s) for s in self.manifest}
            knowledge = from_proto(self.reader.knowledge)
        h, nbytes = self.header, self.reader.bytes
        self.header = self.reader = self.shared = None
        self.buffers = {}
        return ReceivedModel(
            h.round, h.train, h.final, state, knowledge, nbytes, h.adapt, h.upload_delta, h.asynchronous
        )

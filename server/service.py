"""gRPC handlers for ``wafl.v1.Federation``: messages in and out, one refusal type mapped to statuses.

Every decision lives elsewhere: the engine admits joins, checks session credentials, streams
each client's models and records reports; :func:`~wafl.server.upload.receive_upload` owns the
whole upload path. A :class:`~wafl.common.errors.Refused` becomes the gRPC status it names,
with its message (cut to :data:`MAX_DETAILS` characters). Requests that cannot be decoded are
refused with ``INVALID_ARGUMENT`` and a fixed message.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import cast

import grpc
import structlog
from wafl.common.contract import CREDENTIAL_KEY, DELTA_UPLOADS_VERSION, SUPPORTED_VERSIONS
from wafl.common.errors import AlreadyAccepted, Code, Refused
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import MALFORMED, decode_upload, encode_broadcast, lenient
from wafl.server.auth import certificate_index, check_certificate
from wafl.server.engine import RoundEngine
from wafl.server.limits import ClientCalls, FailedJoins, peer_host
from wafl.server.upload import receive_upload

SERVICE = "wafl.v1.Federation"
MAX_DETAILS = 300  # characters of a status's details
WRITE_SETTLE_S = 10.0  # a replaced stream's write under way may finish within this before its status is sent
log = structlog.get_logger("server")


def _details(message: str) -> str:
    return message if len(message) <= MAX_DETAILS else message[: MAX_DETAILS - 3] + "..."


async def _abort(ctx: grpc.aio.ServicerContext, e: Refused) -> None:
    await ctx.abort(getattr(grpc.StatusCode, e.code.value), _details(str(e)))


def _credential(ctx: grpc.aio.ServicerContext) -> str:
    for key, value in ctx.invocation_metadata() or ():
        if key == CREDENTIAL_KEY:
            return value if isinstance(value, str) else ""
    return ""


async def _write(ctx: grpc.aio.ServicerContext, msg: object) -> None:
    """``ctx.write(msg)``, shielded: when the call's task is cancelled (a newer stream replaced it) the
    write already under way goes on, for at most :data:`WRITE_SETTLE_S`, before the cancellation
    goes on. The status that ends the call can only follow a finished write: gRPC refuses to send
    it while a message is still pending (``GRPC_CALL_ERROR_TOO_MANY_OPERATIONS``), and the call
    would stay open."""
    write = asyncio.ensure_future(ctx.write(msg))
    try:
        await asyncio.shield(write)
    except asyncio.CancelledError:
        await asyncio.wait({write}, timeout=WRITE_SETTLE_S)
        raise


@dataclass
class RateLimit:
    """A token bucket per client: ``burst`` calls at once, ``per_s`` more each second."""

    burst: float = 30.0
    per_s: float = 5.0

    def __post_init__(self) -> None:
        self.buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)

    def allow(self, client_id: str, now: float) -> bool:
        tokens, then = self.buckets.get(client_id, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.per_s)
        if tokens < 1.0:
            self.buckets[client_id] = (tokens, now)
            return False
        self.buckets[client_id] = (tokens - 1.0, now)
        return True


def _well_formed(req: object) -> None:
    if req is MALFORMED:
        raise Refused("malformed message")


class FederationService:
    def __init__(
        self, engine: RoundEngine, client_certificates: bool = False, calls: ClientCalls | None = None
    ) -> None:
        self.engine = engine
        self.calls = calls or ClientCalls()  # each client's budget, shared with the server's Admission
        self.report_rate = RateLimit()  # a client reports about once per round: far below this
        self.client_certificates = client_certificates  # mutual TLS: the peer's certificate names its index
        self.failed_joins = FailedJoins()  # Joins with a bad secret: counted, logged and limited per address

    def _certificate_bound(self, ctx: grpc.aio.ServicerContext, index: int | None = None) -> None:
        """Under mutual TLS, the Join's ``index`` (or, without one, the index of the call's session
        credential) must be the one the peer's certificate names; raises :class:`Refused`."""
        if not self.client_certificates:
            return
        peer = certificate_index(ctx.auth_context())
        if index is not None:
            check_certificate(peer, index, "this Join's client_index")
            return
        head = _credential(ctx).partition(".")[0]
        if head.isdigit() and len(head) <= 9:  # the credential itself is verified by the engine
            check_certificate(peer, int(head), "the session credential's")

    async def join(self, req: pb.JoinRequest, ctx: grpc.aio.ServicerContext) -> pb.JoinReply:
        peer = peer_host(ctx.peer() or "")
        try:
            self.failed_joins.check(peer)
            _well_formed(req)
            if req.protocol_version not in SUPPORTED_VERSIONS:
                speaks = " and ".join(str(v) for v in SUPPORTED_VERSIONS)
                raise Refused(
                    f"protocol_version {req.protocol_version} is not supported (server speaks {speaks})",
                    Code.FAILED_PRECONDITION,
                )
            if req.protocol_version < DELTA_UPLOADS_VERSION and self.engine.strategy.uploads_are_deltas:
                raise Refused(
                    f"protocol_version {req.protocol_version}: this run's aggregation "
                    f"({self.engine.cfg.rule.aggregation}) takes uploads as differences to the model sent, which a "
                    f"version {req.protocol_version} client does not upload; use a client of version "
                    f"{DELTA_UPLOADS_VERSION}",
                    Code.FAILED_PRECONDITION,
                )
            self._certificate_bound(ctx, req.client_index)
            return self.engine.join(req, _credential(ctx))
        except Refused as e:
            if e.code == Code.UNAUTHENTICATED:  # a bad token or secret (or no client certificate)
                self.failed_joins.failed(peer)
            await _abort(ctx, e)
            raise

    async def broadcasts(self, req: pb.BroadcastRequest, ctx: grpc.aio.ServicerContext) -> None:
        """Writes the client's models with ``ctx.write`` rather than yielding them: a newer stream of the
        same client cancels this one's task (:meth:`ClientCalls.stream`), and a cancellation that lands
        in a write must reach this code, which ends the call with ``CANCELLED``. Yielded from an async
        generator, the write is gRPC's own, which swallows the cancellation and leaves the call open
        and idle until the client gives up."""
        try:
            _well_formed(req)
            self._certificate_bound(ctx)
            self.engine.authorize(req.client_id, _credential(ctx))
            if req.run_id and req.run_id != self.engine.run_id:
                raise Refused(
                    f"run_id {req.run_id[:64]!r} is not this run ({self.engine.run_id!r})", Code.FAILED_PRECONDITION
                )
            index = self.engine.credential_holder(_credential(ctx))
            async with self.calls.stream(index):
                with self.engine.presence.streaming(index, time.monotonic):  # the session is live meanwhile
                    models = cast(AsyncGenerator[object, None], self.engine.deliveries(req.client_id, _credential(ctx)))
                    async with contextlib.aclosing(models):
                        async for msg in models:
                            await _write(ctx, msg)
        except Refused as e:
            await _abort(ctx, e)

    async def upload(self, requests: AsyncIterator[object], ctx: grpc.aio.ServicerContext) -> pb.UploadReply:
        try:
            self._certificate_bound(ctx)
            round, nbytes = await receive_upload(self.engine.uploads, requests, _credential(ctx))
        except AlreadyAccepted as e:
            await self._drain(requests)
            return pb.UploadReply(accepted=True, round=e.version, bytes_received=e.nbytes)
        except Refused as e:
            log.warning("upload.rejected", code=e.code.value, reason=_details(str(e)))
            if e.code not in (Code.DEADLINE_EXCEEDED, Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
                await self._drain(requests)
            await _abort(ctx, e)
            raise
        return pb.UploadReply(accepted=True, round=round, bytes_received=nbytes)

    async def _drain(self, requests: AsyncIterator[object], budget_s: float = 10.0) -> None:
        """Reads (and drops) the rest of a refused upload, at most one model's worth of messages
        for at most ``budget_s``, before its status is sent. grpcio's asyncio client reports
        INTERNAL ("Internal error from Core") instead of the server's status when the call ends
        while it is still writing (grpc/grpc#36066); a client that gets its status after it
        half-closed learns the real reason and does not retry a refusal as a transient error.
        Callers without a valid credential and stalled streams are not waited for."""
        budget = self.engine.max_upload_messages
        try:
            async with asyncio.timeout(budget_s):
                async for _ in requests:
                    budget -= 1
                    if budget <= 0:
                        return
        except (TimeoutError, grpc.RpcError):
            return

    async def report(self, req: pb.ReportRequest, ctx: grpc.aio.ServicerContext) -> pb.ReportReply:
        try:
            _well_formed(req)
            self._certificate_bound(ctx)
            self.engine.authorize(req.client_id, _credential(ctx))  # a bucket only for a joined client
            if not self.report_rate.allow(req.client_id, time.monotonic()):
                raise Refused("too many reports from this client; slow down", Code.RESOURCE_EXHAUSTED)
            self.engine.report(req, _credential(ctx))
        except Refused as e:
            await _abort(ctx, e)
        return pb.ReportReply()


def handlers(service: FederationService) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Join": unary(service.join, lenient(pb.JoinRequest.FromString), pb.JoinReply.SerializeToString),
            "Broadcasts": grpc.unary_stream_rpc_method_handler(
                service.broadcasts, lenient(pb.BroadcastRequest.FromString), encode_broadcast
            ),
            "Upload": grpc.stream_unary_rpc_method_handler(
                service.upload, lenient(decode_upload), pb.UploadReply.SerializeToString
            ),
            "Report": unary(service.report, lenient(pb.ReportRequest.FromString), pb.ReportReply.SerializeToString),
        },
    )

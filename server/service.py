"""gRPC handlers for ``wafl.v1.Federation``: messages in and out, one refusal type mapped to statuses.

Every decision lives elsewhere: the engine admits joins, streams each client's models and
records reports; :func:`~wafl.server.upload.receive_upload` owns the whole upload path. A
:class:`~wafl.common.errors.Refused` becomes the gRPC status it names, with its message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog
from wafl.common.errors import AlreadyAccepted, Refused
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import decode_upload, encode_broadcast
from wafl.server.engine import RoundEngine
from wafl.server.upload import receive_upload

PROTOCOL_VERSION = 1
SERVICE = "wafl.v1.Federation"
log = structlog.get_logger("server")


async def _abort(ctx: grpc.aio.ServicerContext, e: Refused) -> None:
    await ctx.abort(getattr(grpc.StatusCode, e.code.value), str(e))


class FederationService:
    def __init__(self, engine: RoundEngine) -> None:
        self.engine = engine

    async def join(self, req: pb.JoinRequest, ctx: grpc.aio.ServicerContext) -> pb.JoinReply:
        if req.protocol_version != PROTOCOL_VERSION:
            await ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol_version {req.protocol_version} is not supported (server speaks {PROTOCOL_VERSION})",
            )
        try:
            return self.engine.join(req)
        except Refused as e:
            await _abort(ctx, e)
            raise

    async def broadcasts(self, req: pb.BroadcastRequest, ctx: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        if req.run_id and req.run_id != self.engine.run_id:
            await ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run_id {req.run_id!r} is not this run ({self.engine.run_id!r})",
            )
        try:
            async for msg in self.engine.deliveries(req.client_id):
                yield msg
        except Refused as e:
            await _abort(ctx, e)

    async def upload(self, requests: AsyncIterator[object], ctx: grpc.aio.ServicerContext) -> pb.UploadReply:
        try:
            round, nbytes = await receive_upload(self.engine, requests)
        except AlreadyAccepted as e:
            await self._drain(requests)
            return pb.UploadReply(accepted=True, round=e.round, bytes_received=e.nbytes)
        except Refused as e:
            log.warning("upload.rejected", code=e.code.value, reason=str(e))
            await self._drain(requests)
            await _abort(ctx, e)
            raise
        return pb.UploadReply(accepted=True, round=round, bytes_received=nbytes)

    async def _drain(self, requests: AsyncIterator[object], budget_s: float = 10.0) -> None:
        """Reads (and drops) the rest of a refused upload, at most one model's worth of messages
        for at most ``budget_s``, before its status is sent. grpcio's asyncio client reports
        INTERNAL ("Internal error from Core") instead of the server's status when the call ends
        while it is still writing (grpc/grpc#36066); a client that gets its status after it
        half-closed learns the real reason and does not retry a refusal as a transient error."""
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
            self.engine.report(req)
        except Refused as e:
            await _abort(ctx, e)
        return pb.ReportReply()


def handlers(service: FederationService) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Join": unary(service.join, pb.JoinRequest.FromString, pb.JoinReply.SerializeToString),
            "Broadcasts": grpc.unary_stream_rpc_method_handler(
                service.broadcasts, pb.BroadcastRequest.FromString, encode_broadcast
            ),
            "Upload": grpc.stream_unary_rpc_method_handler(
                service.upload, decode_upload, pb.UploadReply.SerializeToString
            ),
            "Report": unary(service.report, pb.ReportRequest.FromString, pb.ReportReply.SerializeToString),
        },
    )

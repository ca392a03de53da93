"""gRPC handlers for ``wafl.v1.Federation``: message checks and status codes, no run logic.

Every refusal is a precise status; nothing a client sends can change the global model unless
its upload completes and passes every check (see ``aggregator.py`` for how a partial upload
is undone).
"""
from __future__ import annotations

import asyncio
import zlib
from concurrent.futures import Executor
from typing import AsyncIterator

import grpc
import structlog

from wafl.common.codec import ChunkError, RawChunk, TensorSpec, TransferChecker
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import decode_upload, encode_broadcast
from wafl.server.aggregator import UploadFold
from wafl.server.engine import RoundEngine, UploadRefused, decode_knowledge

PROTOCOL_VERSION = 1
SERVICE = "wafl.v1.Federation"
log = structlog.get_logger("server")


def _status(code: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, code)


class FederationService:
    def __init__(self, engine: RoundEngine) -> None:
        self.engine = engine

    async def join(self, req: pb.JoinRequest, ctx: grpc.aio.ServicerContext) -> pb.JoinReply:
        if req.protocol_version != PROTOCOL_VERSION:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"protocol_version {req.protocol_version} is not supported (server speaks {PROTOCOL_VERSION})")
        try:
            self.engine.join(req)
        except PermissionError as e:
            await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        except FileExistsError as e:
            await ctx.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except ValueError as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return self.engine.join_reply()

    async def broadcasts(self, req: pb.BroadcastRequest, ctx: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        if req.client_id not in self.engine.clients:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"unknown client_id {req.client_id!r}: call Join first")
        if req.run_id and req.run_id != self.engine.run_id:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"run_id {req.run_id!r} is not this run ({self.engine.run_id!r})")
        version = 0
        while True:
            bc = await self.engine.next_broadcast(version)
            version = bc.version
            yield pb.BroadcastMessage(header=bc.header)
            for chunk in bc.chunks:
                yield chunk
            for k in bc.knowledge:
                yield pb.BroadcastMessage(knowledge=k)
            yield pb.BroadcastMessage(trailer=bc.trailer)
            self.engine.bytes_down += bc.nbytes
            if bc.header.final:
                return

    async def upload(self, requests: AsyncIterator[object], ctx: grpc.aio.ServicerContext) -> pb.UploadReply:
        engine = self.engine
        it = requests.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty upload: the first message must be a header")
        if isinstance(first, RawChunk) or first.WhichOneof("kind") != "header":
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of an upload must be a header")
        h = first.header
        try:
            state = engine.check_upload(h)
        except UploadRefused as e:
            if e.code == "OK":
                return pb.UploadReply(accepted=True, round=h.round, bytes_received=0)
            await ctx.abort(_status(e.code), str(e))
        cid = h.client_id
        loop = asyncio.get_running_loop()
        state.in_flight.add(cid)
        fold = state.accumulator.begin(engine.algorithm.server.weight(h.num_samples))
        folding = FoldPipeline(fold, engine.executor)
        checker = TransferChecker(engine.manifest, require_finite=False, compute_crc=False)  # the fold checks values and keeps the CRC
        knowledge: list[pb.ClassKnowledge] = []
        trailer: pb.UploadTrailer | None = None
        code, message = None, None
        try:
            async for msg in it:
                if trailer is not None:
                    raise ChunkError("message after the trailer")
                if isinstance(msg, RawChunk):
                    if knowledge:
                        raise ChunkError("tensor chunk after knowledge")
                    await folding.put(checker.check(msg), msg)
                    continue
                kind = msg.WhichOneof("kind")
                if kind == "knowledge":
                    if engine.algorithm.knowledge is None:
                        raise ChunkError(f"algorithm {engine.cfg.algorithm!r} takes no knowledge")
                    if len(knowledge) >= engine.dataset.num_classes:
                        raise ChunkError(f"more than {engine.dataset.num_classes} knowledge entries")
                    knowledge.append(msg.knowledge)
                elif kind == "trailer":
                    trailer = msg.trailer
                else:
                    raise ChunkError(f"unexpected {kind or 'empty'} message inside an upload")
            if trailer is None:
                raise ChunkError("the upload ended without a trailer (stream cut off)")
            await folding.finish()
            checker.finish(trailer.crc32, folding.crc)
            if trailer.num_chunks and trailer.num_chunks != checker.chunks:
                raise ChunkError(f"trailer counts {trailer.num_chunks} chunks, {checker.chunks} arrived")
            parsed = None
            if engine.algorithm.knowledge is not None:
                parsed = _checked_knowledge(knowledge, engine.dataset.num_classes, engine.cfg.code_len)
            if state.closed:
                raise ChunkError(f"round {h.round} closed while the upload was streaming", "ABORTED")
            fold.commit()
            engine.accept(state, h, parsed, checker.bytes)
            log.info("upload.accepted", client=cid, round=h.round, bytes=checker.bytes)
            return pb.UploadReply(accepted=True, round=h.round, bytes_received=checker.bytes)
        except ChunkError as e:
            code, message = e.code, str(e)
        finally:
            state.in_flight.discard(cid)
            await folding.stop()
            if fold.state == "open":
                await loop.run_in_executor(engine.executor, fold.rollback)
        log.warning("upload.rejected", client=cid, round=h.round, code=code, reason=message)
        await ctx.abort(_status(code or "INTERNAL"), message or "upload failed")

    async def report(self, req: pb.ReportRequest, ctx: grpc.aio.ServicerContext) -> pb.ReportReply:
        try:
            self.engine.report(req)
        except UploadRefused as e:
            await ctx.abort(_status(e.code), str(e))
        return pb.ReportReply()


class FoldPipeline:
    """Folds an upload's chunks in a worker thread, in order, while the event loop receives the
    next ones; at most ``depth`` chunks wait, so memory stays bounded and flow control holds the
    sender back when folding is the slower side."""

    def __init__(self, fold: UploadFold, executor: Executor, depth: int = 3) -> None:
        self.fold = fold
        self.executor = executor
        self.crc = 0  # running CRC-32 of the chunks folded, in order
        self.stopping = False
        self.queue: asyncio.Queue[tuple[TensorSpec, RawChunk] | None] = asyncio.Queue(depth)
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while (item := await self.queue.get()) is not None and not self.stopping:
            # shielded: a fold already handed to a thread always completes before anyone rolls back
            await asyncio.shield(loop.run_in_executor(self.executor, self._add, *item))

    def _add(self, spec: TensorSpec, chunk: RawChunk) -> None:
        self.crc = zlib.crc32(chunk.data, self.crc)
        self.fold.add(spec, chunk)

    async def put(self, spec: TensorSpec, chunk: RawChunk) -> None:
        if self.task.done():
            self.task.result()  # the fold's own error (NaN, round closed)
        if not self.queue.full():
            self.queue.put_nowait((spec, chunk))
            return
        put = asyncio.ensure_future(self.queue.put((spec, chunk)))
        await asyncio.wait({put, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
        if self.task.done():
            self.task.result()

    async def finish(self) -> None:
        """Waits until every chunk is folded; raises the first fold error."""
        if not self.task.done():
            await self.queue.put(None)
        await self.task

    async def stop(self) -> None:
        """Drops what is queued and waits for the fold in progress, so that a rollback can follow."""
        self.stopping = True
        while not self.queue.empty():
            self.queue.get_nowait()
        if not self.task.done():
            self.queue.put_nowait(None)
        await asyncio.gather(self.task, return_exceptions=True)


def _checked_knowledge(messages: list[pb.ClassKnowledge], num_classes: int, code_len: int):
    from wafl.common.algorithms.hyperknowledge import validate_knowledge

    try:
        k = decode_knowledge(messages)
        validate_knowledge(k, num_classes, code_len)
    except ValueError as e:
        raise ChunkError(f"knowledge: {e}") from None
    return k


def handlers(service: FederationService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Join": grpc.unary_unary_rpc_method_handler(service.join, request_deserializer=pb.JoinRequest.FromString, response_serializer=pb.JoinReply.SerializeToString),
            "Broadcasts": grpc.unary_stream_rpc_method_handler(service.broadcasts, request_deserializer=pb.BroadcastRequest.FromString, response_serializer=encode_broadcast),
            "Upload": grpc.stream_unary_rpc_method_handler(service.upload, request_deserializer=decode_upload, response_serializer=pb.UploadReply.SerializeToString),
            "Report": grpc.unary_unary_rpc_method_handler(service.report, request_deserializer=pb.ReportRequest.FromString, response_serializer=pb.ReportReply.SerializeToString),
        },
    )

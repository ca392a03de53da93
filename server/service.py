"""gRPC handlers for ``wafl.v1.Federation``: message checks and status codes, no run logic.

Every refusal is a precise status; nothing a client sends can change the global model unless
its upload completes and passes every check (see ``aggregator.py`` for how a partial upload
is undone).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

import grpc
import structlog
from wafl.common.checksum import crc32
from wafl.common.codec import ChunkError, RawChunk, TensorSpec, TransferChecker
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import ChunkBatch, chunks_of, decode_upload, encode_broadcast
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
            await ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol_version {req.protocol_version} is not supported (server speaks {PROTOCOL_VERSION})",
            )
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
            await ctx.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"run_id {req.run_id!r} is not this run ({self.engine.run_id!r})"
            )
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
        if isinstance(first, (RawChunk, ChunkBatch)) or first.WhichOneof("kind") != "header":
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
        folding = FoldPipeline(fold)
        checker = TransferChecker(
            engine.manifest, require_finite=False, compute_crc=False
        )  # the fold checks values and keeps the CRC
        knowledge: list[pb.ClassKnowledge] = []
        trailer: pb.UploadTrailer | None = None
        code, message = None, None
        try:
            async for msg in it:
                if trailer is not None:
                    raise ChunkError("message after the trailer")
                if isinstance(msg, (RawChunk, ChunkBatch)):
                    chunks = chunks_of(msg)
                    if knowledge:
                        raise ChunkError("tensor chunk after knowledge")
                    if not chunks:
                        raise ChunkError("empty chunk batch")
                    await folding.put([(checker.check(c), c) for c in chunks])
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
    """Folds an upload's chunks in its own thread, in order, while the event loop receives the
    next ones. At most ``depth`` messages wait, so memory stays bounded and HTTP/2 flow control
    holds the sender back when folding is the slower side. The loop only hands chunks over
    (no future, no wake-up per chunk); it is woken when it waits for room or for the end."""

    def __init__(self, fold: UploadFold, depth: int = 4) -> None:
        self.fold = fold
        self.depth = depth
        self.crc = 0  # running CRC-32 of the chunks folded, in order
        self.loop = asyncio.get_running_loop()
        self.items: queue.SimpleQueue[list[tuple[TensorSpec, RawChunk]] | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.pending = 0
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.stopping = False
        self.finished: asyncio.Future[None] = self.loop.create_future()
        self.thread = threading.Thread(target=self._run, name="wafl-fold", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while (items := self.items.get()) is not None:
                for spec, chunk in items:
                    if self.error is not None or self.stopping:
                        break
                    try:
                        self.crc = crc32(chunk.data, self.crc)
                        self.fold.add(spec, chunk)
                    except BaseException as e:  # reported to the handler by put/finish
                        self.error = e
                with self.lock:
                    self.pending -= 1
                    if self.waiter is not None and (self.pending < self.depth or self.error is not None):
                        self._wake(self.waiter)
                        self.waiter = None
        finally:
            self._wake(self.finished)

    def _wake(self, f: asyncio.Future[None]) -> None:
        try:
            self.loop.call_soon_threadsafe(_resolve, f)
        except RuntimeError:  # the loop is gone (server shut down mid-upload): nobody waits
            pass

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    async def put(self, items: list[tuple[TensorSpec, RawChunk]]) -> None:
        """Hands one message's chunks over; waits only while ``depth`` messages are still
        queued. Raises the fold's first error (NaN, the round closed)."""
        self._raise()
        with self.lock:
            self.pending += 1
            self.items.put(items)
            waiter = None
            if self.pending >= self.depth and self.error is None:
                waiter = self.waiter = self.loop.create_future()
        if waiter is not None:
            await waiter
        self._raise()

    async def finish(self) -> None:
        """Waits until every chunk is folded; raises the first fold error."""
        self.items.put(None)
        await asyncio.shield(self.finished)
        self._raise()

    async def stop(self) -> None:
        """Drops what is queued and waits for the fold in progress, so that a rollback can follow."""
        self.stopping = True
        if not self.finished.done():
            self.items.put(None)
        await asyncio.shield(self.finished)


def _resolve(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)


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
            "Join": grpc.unary_unary_rpc_method_handler(
                service.join,
                request_deserializer=pb.JoinRequest.FromString,
                response_serializer=pb.JoinReply.SerializeToString,
            ),
            "Broadcasts": grpc.unary_stream_rpc_method_handler(
                service.broadcasts,
                request_deserializer=pb.BroadcastRequest.FromString,
                response_serializer=encode_broadcast,
            ),
            "Upload": grpc.stream_unary_rpc_method_handler(
                service.upload, request_deserializer=decode_upload, response_serializer=pb.UploadReply.SerializeToString
            ),
            "Report": grpc.unary_unary_rpc_method_handler(
                service.report,
                request_deserializer=pb.ReportRequest.FromString,
                response_serializer=pb.ReportReply.SerializeToString,
            ),
        },
    )

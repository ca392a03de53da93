"""One upload, from its header to its commit or rollback, whatever carries its messages.

:func:`receive_upload` is the whole upload path: the server (an :class:`UploadHost`) admits the
header (its strategy decides the collection and the weight) and hands back an :class:`Upload`; each
tensor message is checked against the manifest (:class:`~wafl.common.wire.TransferReader`) and folded by the
server's fold workers (:class:`FoldPipeline` on :class:`FoldWorkers`, a fixed set of threads
whatever the uploads in flight) while the next one arrives; the trailer's CRC, the
knowledge and the chunk count are checked; then the host commits it. Any failure rolls the
fold back before the refusal propagates, so a refused upload never reaches a model.

The commit point is :meth:`Upload.finish`'s call of its host's ``commit``, after the trailer
passed: from then on the upload is in its collection, and a retry under its idempotency key is
answered with its reply for the rest of the run, whatever became of the first reply (lost, or
the call cancelled after the trailer). Before that point nothing of it remains after a failure,
a cancelled or cut-off stream included, and a retry is judged as a new upload. The gRPC
service and the in-process transport both call :func:`receive_upload` and only translate its
outcome (:class:`~wafl.common.errors.Refused`, :class:`~wafl.common.errors.AlreadyAccepted`).
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Protocol

from wafl.common.checksum import crc32
from wafl.common.codec import ChunkError, Manifest, RawChunk, TensorSpec
from wafl.common.errors import Code, Refused
from wafl.common.knowledge import Knowledge, from_proto, validate_knowledge
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import MALFORMED, TransferReader
from wafl.server.aggregation.accumulator import FoldState, UploadFold
from wafl.server.strategies.base import Drain, Ticket


class UploadHost(Protocol):
    """What an upload needs of the server that receives it, and nothing more: :func:`receive_upload` and
    :class:`Upload` know the server only through it (the server's upload registry,
    :class:`~wafl.server.upload_registry.UploadRegistry`, implements it)."""

    @property
    def upload_stall_s(self) -> float: ...  # an upload with no message for this long is cut off

    @property
    def manifest(self) -> Manifest: ...  # the tensors every upload carries, in order

    @property
    def takes_knowledge(self) -> bool: ...  # uploads carry class knowledge (the algorithm shares some)

    @property
    def num_classes(self) -> int: ...

    @property
    def code_len(self) -> int: ...  # the length of a knowledge entry's representation

    @property
    def drain(self) -> Drain: ...  # what becomes of an upload still streaming when its collection closes

    @property
    def fold_workers(self) -> FoldWorkers: ...  # fold every upload's chunks

    @property
    def executor(self) -> Executor: ...  # runs a fold's rollback

    async def open_upload(self, h: pb.UploadHeader, credential: str = "") -> Upload:
        """Admits an upload's header (or raises :class:`Refused`)."""
        ...

    def commit(self, upload: Upload, knowledge: Knowledge | None) -> None:
        """The upload passed every check and its fold is committed: it is in its collection."""
        ...

    def release(self, upload: Upload) -> None:
        """The upload ended without a commit: its place in the collection is given back."""
        ...

    def settle(self, upload: Upload) -> None:
        """The upload's attempt ended, committed or rolled back (a retry under its key may go on)."""
        ...


async def receive_upload(host: UploadHost, messages: AsyncIterator[object], credential: str = "") -> tuple[int, int]:
    """Receives one upload stream; returns ``(round, bytes)`` once it is committed.

    ``credential`` is the caller's session credential. Raises :class:`Refused` for anything wrong
    with it (after rolling back what was folded), ``DEADLINE_EXCEEDED`` when no message arrives
    for ``upload_stall_s``, and :class:`~wafl.common.errors.AlreadyAccepted` for a retry of a
    committed upload.
    """
    it = messages.__aiter__()
    watch = StallWatch(host.upload_stall_s)
    try:
        first = await _next(it, watch)
    except StopAsyncIteration:
        raise Refused("empty upload: the first message must be a header") from None
    if first is MALFORMED:
        raise Refused("malformed message")
    if not isinstance(first, pb.UploadMessage) or first.WhichOneof("kind") != "header":
        raise Refused("the first message of an upload must be a header")
    try:
        upload = await host.open_upload(first.header, credential)
        try:
            while True:
                try:
                    msg = await _next(it, watch)
                except StopAsyncIteration:
                    break
                await upload.feed(msg)
            return await upload.finish()
        finally:
            await upload.close()
    finally:
        watch.close()


class StallWatch:
    """Cuts an upload off when no message arrives for ``stall_s`` while it waits for one: one timer
    for the whole upload, moved on lazily, instead of a timeout armed and cancelled per message."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.since: float | None = None  # when the current wait for a message began
        self.fired = False
        self.handle: asyncio.TimerHandle | None = None

    def waiting(self) -> None:
        self.since = self.loop.time()
        if self.handle is None:
            self.handle = self.loop.call_at(self.since + self.stall_s, self._check)

    def _check(self) -> None:
        self.handle = None
        if self.since is None:
            return  # not waiting for a message: armed again by the next wait
        due = self.since + self.stall_s
        if self.loop.time() < due:
            self.handle = self.loop.call_at(due, self._check)
        elif self.task is not None:
            self.fired = True
            self.task.cancel()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


async def _next(it: AsyncIterator[object], watch: StallWatch) -> object:
    """The stream's next message; ``DEADLINE_EXCEEDED`` when none arrives within the watch's ``stall_s``."""
    watch.waiting()
    try:
        return await it.__anext__()
    except asyncio.CancelledError:
        if not watch.fired:
            raise
        watch.fired = False
        if watch.task is not None:
            watch.task.uncancel()
        raise Refused(f"no message for {watch.stall_s:g} s: the upload was cut off", Code.DEADLINE_EXCEEDED) from None
    finally:
        watch.since = None


class Upload:
    """An admitted upload: checks, fold, then :meth:`finish` (commit) or :meth:`close` (rollback)."""

    def __init__(self, host: UploadHost, header: pb.UploadHeader, ticket: Ticket) -> None:
        self.host = host
        self.header = header
        self.ticket = ticket
        knowledge_entries = host.num_classes if host.takes_knowledge else 0
        self.reader = TransferReader(
            host.manifest, knowledge_entries, compute_crc=False
        )  # the fold thread keeps the CRC
        self.fold = ticket.collection.accumulator.begin(ticket.weight)
        self.pipeline = FoldPipeline(self.fold, host.fold_workers)
        self.committed = False
        self.settled = asyncio.Event()  # set once committed or rolled back (a retry under its key waits)

    async def feed(self, msg: object) -> None:
        items = self.reader.feed(msg)
        if items:
            await self.pipeline.put(items)

    async def finish(self) -> tuple[int, int]:
        await self.pipeline.finish()
        self.reader.finish(self.pipeline.crc)
        knowledge = self._knowledge()
        if self.ticket.collection.closed and self.host.drain is Drain.CANCEL:
            raise Refused(f"round {self.header.round} closed while the upload was streaming", Code.ABORTED)
        self.fold.commit()
        self.host.commit(self, knowledge)
        self.committed = True
        return self.header.round, self.reader.bytes

    def _knowledge(self) -> Knowledge | None:
        host = self.host
        if not host.takes_knowledge:
            return None
        try:
            k = from_proto(self.reader.knowledge)
            validate_knowledge(k, host.num_classes, host.code_len)
        except ValueError as err:
            raise ChunkError(f"knowledge: {err}") from None
        total = sum(ck.count for ck in k.values())
        if total > self.ticket.samples:  # the counts weight the knowledge: no more than the upload's samples
            raise ChunkError(
                f"knowledge: class counts sum to {total}, more than the upload's {self.ticket.samples} samples"
            )
        return k

    async def close(self) -> None:
        """Ends the upload: a fold that was not committed is rolled back (in a worker thread), its
        place in the round is given back and its attempt settled. The cleanup runs to its end even
        when the caller is cancelled (again) meanwhile: a retry must never find the attempt settled
        while it still holds its place, nor its fold open."""
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        try:
            await self.pipeline.stop()
            if self.fold.state is FoldState.OPEN:
                await asyncio.get_running_loop().run_in_executor(self.host.executor, self.fold.rollback)
            if not self.committed:
                self.host.release(self)
        finally:
            self.host.settle(self)


class FoldWorkers:
    """A fixed set of threads that fold the chunks of every upload, however many are in flight:
    an upload costs a queue, not a thread. Each upload's chunks are folded in order, by one
    worker at a time; a worker takes at most ``slice_messages`` messages of one upload before the
    next upload that has some waiting, so a burst of uploads shares the workers."""

    def __init__(self, threads: int | None = None, slice_messages: int = 8) -> None:
        self.threads = threads or min(8, max(2, os.cpu_count() or 2))
        self.slice_messages = slice_messages
        self.ready: queue.SimpleQueue[FoldPipeline | None] = queue.SimpleQueue()
        self.started: list[threading.Thread] = []
        self.lock = threading.Lock()

    def schedule(self, pipeline: FoldPipeline) -> None:
        if len(self.started) < self.threads:
            with self.lock:
                while len(self.started) < self.threads:
                    t = threading.Thread(target=self._run, name=f"wafl-fold-{len(self.started)}", daemon=True)
                    t.start()
                    self.started.append(t)
        self.ready.put(pipeline)

    def _run(self) -> None:
        while (pipeline := self.ready.get()) is not None:
            if pipeline._work(self.slice_messages):
                self.ready.put(pipeline)  # more of it waits: after the uploads queued meanwhile

    def shutdown(self) -> None:
        for _ in self.started:
            self.ready.put(None)


class FoldPipeline:
    """Folds an upload's chunks on the shared :class:`FoldWorkers`, in order, while the event loop
    receives the next ones. At most ``depth`` messages wait, so memory stays bounded and HTTP/2
    flow control holds the sender back when folding is the slower side. The loop only hands
    chunks over (no future, no wake-up per chunk); it is woken when it waits for room or for the
    end."""

    END = None  # queued by finish/stop: nothing follows

    def __init__(self, fold: UploadFold, workers: FoldWorkers, depth: int = 4) -> None:
        self.fold = fold
        self.workers = workers
        self.depth = depth
        self.crc = 0  # running CRC-32 of the chunks folded, in order
        self.loop = asyncio.get_running_loop()
        self.items: collections.deque[list[tuple[TensorSpec, RawChunk]] | None] = collections.deque()
        self.lock = threading.Lock()
        self.scheduled = False  # on the workers' queue or being worked on
        self.ended = False
        self.pending = 0
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.stopping = False
        self.finished: asyncio.Future[None] = self.loop.create_future()

    def _enqueue(self, items: list[tuple[TensorSpec, RawChunk]] | None) -> None:
        """Queues one message (lock held by the caller) and schedules the pipeline if it is idle."""
        self.items.append(items)
        if not self.scheduled:
            self.scheduled = True
            self.workers.schedule(self)

    def _work(self, budget: int) -> bool:
        """Folds up to ``budget`` queued messages (a worker thread); True when more are queued."""
        for _ in range(budget):
            with self.lock:
                if self.ended or not self.items:
                    self.scheduled = False
                    return False
                items = self.items.popleft()
            if items is self.END:
                with self.lock:
                    self.ended = True
                    self.scheduled = False
                    self.items.clear()
                self._wake(self.finished)
                return False
            for spec, chunk in items:
                if self.error is not None or self.stopping:
                    break
                try:
                    self.crc = crc32(chunk.data, self.crc)
                    self.fold.add(spec, chunk)
                # every error, not only Exception: it is this upload's, re-raised in its handler by
                # put/finish, and the fold worker, shared by every upload, must live on
                except BaseException as e:
                    self.error = e
            with self.lock:
                self.pending -= 1
                if self.waiter is not None and (self.pending < self.depth or self.error is not None):
                    self._wake(self.waiter)
                    self.waiter = None
        with self.lock:
            if self.items and not self.ended:
                return True
            self.scheduled = False
            return False

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
            self._enqueue(items)
            waiter = None
            if self.pending >= self.depth and self.error is None:
                waiter = self.waiter = self.loop.create_future()
        if waiter is not None:
            await waiter
        self._raise()

    async def finish(self) -> None:
        """Waits until every chunk is folded; raises the first fold error."""
        with self.lock:
            if not self.ended:
                self._enqueue(self.END)
        await asyncio.shield(self.finished)
        self._raise()

    async def stop(self) -> None:
        """Drops what is queued and waits for the fold in progress, so that a rollback can follow."""
        self.stopping = True
        with self.lock:
            if not self.ended:
                self._enqueue(self.END)
        await asyncio.shield(self.finished)


def _resolve(f: asyncio.Future[None]) -> None:
    if not f.done():
        f.set_result(None)

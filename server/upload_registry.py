"""The uploads in flight: the admission of an upload's header (the caller's credential, this run, the
idempotency key; then the strategy decides its collection and weight, a :class:`~wafl.server.strategies.base.Ticket`),
one open attempt per (client, version, idempotency key), and what follows when an attempt commits, is
rolled back or ends. It is the :class:`~wafl.server.upload.UploadHost` every
:class:`~wafl.server.upload.Upload` talks to."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import structlog
from wafl.common import metrics as M
from wafl.common.codec import Manifest
from wafl.common.config import RunConfig
from wafl.common.errors import Code, Refused
from wafl.common.knowledge import Knowledge
from wafl.common.proto import federation_pb2 as pb
from wafl.server.mailbox import Mailbox
from wafl.server.roster import Roster
from wafl.server.strategies import Drain, Strategy
from wafl.server.upload import FoldWorkers, Upload

log = structlog.get_logger("server")

MAX_KEY_CHARS = 128  # idempotency keys: 1 to 128 characters
RETRY_WAIT_S = 30.0  # a retry waits this long at most for the earlier attempt under its key to end


class UploadRegistry:
    """Admits uploads and keeps their open attempts. A commit hands the strategy's deliveries to the
    mailbox; a commit or a release sets ``changed`` (the round loop's conditions may have changed). No
    upload is admitted once ``finished`` is set."""

    def __init__(
        self,
        cfg: RunConfig,
        run_id: str,
        roster: Roster,
        strategy: Strategy,
        mailbox: Mailbox,
        manifest: Manifest,
        num_classes: int,
        takes_knowledge: bool,
        fold_workers: FoldWorkers,
        executor: Executor,
        changed: asyncio.Event,
        finished: asyncio.Event,
    ) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.roster = roster
        self.strategy = strategy
        self.mailbox = mailbox
        self.manifest = manifest
        self.num_classes = num_classes
        self.takes_knowledge = takes_knowledge
        self.fold_workers = fold_workers  # fold every upload's chunks: a bounded set of threads
        self.executor = executor
        self.changed = changed
        self.finished = finished
        self.attempts: dict[tuple[str, int, str], Upload] = {}  # open uploads by (client, version, idempotency key)

    @property
    def upload_stall_s(self) -> float:
        return self.cfg.federation.upload_stall_s

    @property
    def code_len(self) -> int:
        return self.cfg.training.code_len

    @property
    def drain(self) -> Drain:
        return self.strategy.drain

    async def open_upload(self, h: pb.UploadHeader, credential: str = "") -> Upload:
        """Admits an upload's header (the strategy decides); raises :class:`Refused`."""
        self.roster.authorize(h.client_id, credential)
        if h.run_id != self.run_id:
            raise Refused(f"run_id {h.run_id[:64]!r} is not this run ({self.run_id!r})", Code.FAILED_PRECONDITION)
        if not 1 <= len(h.idempotency_key) <= MAX_KEY_CHARS:
            raise Refused(f"idempotency_key must have 1 to {MAX_KEY_CHARS} characters (got {len(h.idempotency_key)})")
        M.check(h.metrics, M.UPLOAD, "upload")
        if h.client_id in self.roster.new_clients:
            raise Refused(
                f"client {h.client_id!r} is a new client (new_clients): it does not train", Code.FAILED_PRECONDITION
            )
        await self._after_earlier_attempt(h)
        self.strategy.check_retry(h.client_id, h.round, h.idempotency_key)  # answered for the rest of the run
        if self.finished.is_set():
            raise Refused("the run is over", Code.FAILED_PRECONDITION)
        now = asyncio.get_running_loop().time()
        ticket = self.strategy.open(h.client_id, h.round, h.num_samples, h.idempotency_key, now, h.metrics)
        upload = Upload(self, h, ticket)
        self.attempts[_attempt(h)] = upload
        return upload

    async def _after_earlier_attempt(self, h: pb.UploadHeader) -> None:
        """A retry that arrives while an earlier attempt under its key is still open (its stream's end
        not yet seen here) waits for that attempt's outcome: committed, the retry is answered OK;
        rolled back, the retry is judged as a new upload. After ``RETRY_WAIT_S``: ``UNAVAILABLE``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_WAIT_S
        while (earlier := self.attempts.get(_attempt(h))) is not None:
            try:
                await asyncio.wait_for(earlier.settled.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise Refused(
                    f"an earlier upload under this idempotency_key is still streaming after {RETRY_WAIT_S:g} s; "
                    "retry under the same key",
                    Code.UNAVAILABLE,
                ) from None

    def settle(self, upload: Upload) -> None:
        """An upload attempt ended, committed or rolled back; a retry waiting for it goes on."""
        key = _attempt(upload.header)
        if self.attempts.get(key) is upload:
            del self.attempts[key]
        upload.settled.set()

    def commit(self, upload: Upload, knowledge: Knowledge | None) -> None:
        h = upload.header
        now = asyncio.get_running_loop().time()
        self.mailbox.deliver(self.strategy.commit(upload.ticket, dict(h.metrics), knowledge, upload.reader.bytes, now))
        log.info("upload.accepted", client=h.client_id, round=h.round, bytes=upload.reader.bytes)
        self.changed.set()

    def release(self, upload: Upload) -> None:
        self.strategy.release(upload.ticket)
        self.changed.set()


def _attempt(h: pb.UploadHeader) -> tuple[str, int, str]:
    return (h.client_id, h.round, h.idempotency_key)

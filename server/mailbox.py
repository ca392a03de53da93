"""The models sent to clients: each global model is encoded once (a :class:`Publication`) and put in the
mailbox of each client the strategy decided on (a :class:`Delivery`: train on it or not, adapt it or not);
each client's broadcast stream (:meth:`Mailbox.deliveries`) sends its latest delivery, then waits for the
next one, until the final model, or until the run is aborted (:meth:`Mailbox.abort`: every stream then ends
with ``ABORTED`` and the reason)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import cast

from wafl.common.codec import RawChunk
from wafl.common.errors import Code, Refused
from wafl.common.knowledge import to_proto
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import ChunkBatch, PreEncoded, encode_tensors, write_transfer
from wafl.server.global_model import GlobalModel
from wafl.server.roster import Roster
from wafl.server.strategies import Deliveries, Strategy


@dataclass
class Publication:
    """One global model, encoded once for every recipient."""

    version: int  # the version it is (sync: the round it opens); rounds + 1 (or plateau stop + 1) for the final one
    final: bool
    messages: list[object]  # the transfer after the header: chunk messages, knowledge, trailer
    nbytes: int


@dataclass
class Delivery:
    seq: int
    publication: Publication
    train: bool
    adapt: bool = False  # a new client's: adapt this model and report its accuracy


class Mailbox:
    """Publications of the global model and each client's latest delivery of one. Work handed out for a
    version still being published waits for its publication. Counts what it sends: ``bytes_down`` (reset
    by the round loop at each results line) and ``final_messages`` (messages of the final model, once per
    client and message: progress while the run waits for the final reports)."""

    def __init__(self, model: GlobalModel, strategy: Strategy, roster: Roster, run_id: str, executor: Executor) -> None:
        self.model = model
        self.strategy = strategy
        self.roster = roster
        self.run_id = run_id
        self.executor = executor
        self.publication: Publication | None = None
        self.boxes: dict[str, Delivery] = {}  # per client: its latest delivery
        self.waiting: Deliveries = {}  # decided for the version being published
        self.mail: dict[str, asyncio.Event] = {}  # per client: its mailbox has a newer delivery
        self.seq = 0
        self.final_sent: dict[str, int] = {}  # per client: messages of the final model it was sent
        self.final_messages = 0
        self.bytes_down = 0
        self.aborted: str | None = None  # why the run was aborted, once it was

    async def publish(self, deliveries: Deliveries, final: bool = False) -> None:
        """Encodes the global model once (worker thread) and delivers it as the strategy decided."""
        loop = asyncio.get_running_loop()
        # the final model: the version after the last one built (rounds + 1, or s + 1 after a plateau stop at s)
        version = self.strategy.version
        self.publication = await loop.run_in_executor(self.executor, self._encode, version, final)
        self.deliver(deliveries)

    def _encode(self, version: int, final: bool) -> Publication:
        messages: list[object] = []
        for m in write_transfer(pb.BroadcastMessage, self.model.state.items(), to_proto(self.model.knowledge)):
            # tensors come as RawChunk / ChunkBatch (encoded once here), knowledge and trailer as messages
            messages.append(
                m if isinstance(m, pb.BroadcastMessage) else PreEncoded(encode_tensors(cast(RawChunk | ChunkBatch, m)))
            )
        return Publication(version, final, messages, self.model.nbytes)

    def deliver(self, deliveries: Deliveries) -> None:
        """Sends the current publication as decided; work handed out for a version still being
        published waits for it."""
        self.waiting.update(deliveries)
        p = self.publication
        if not self.waiting or p is None or (p.version != self.strategy.version and not p.final):
            return
        deliveries, self.waiting = self.waiting, {}
        for cid, train in deliveries.items():
            self.seq += 1
            self.boxes[cid] = Delivery(self.seq, p, train, adapt=cid in self.roster.new_clients)
            event = self.mail.get(cid)
            if event is not None:
                event.set()  # wakes this recipient's stream only

    def abort(self, reason: str) -> None:
        """Ends every broadcast stream, the waiting ones and those opened from now on, with ``ABORTED`` and
        ``reason``: a client learns why the run ended, and the server stops without calls to cancel."""
        self.aborted = reason
        for event in self.mail.values():
            event.set()

    async def _next_delivery(self, client_id: str, after: int) -> Delivery:
        event = self.mail.setdefault(client_id, asyncio.Event())
        while True:
            if self.aborted is not None:
                raise Refused(f"the run was aborted: {self.aborted}", Code.ABORTED)
            d = self.boxes.get(client_id)
            if d is not None and d.seq > after:
                return d
            event.clear()
            await event.wait()

    async def deliveries(self, client_id: str, credential: str = "") -> AsyncIterator[object]:
        """The broadcast stream of one client: each model it is sent (its latest one first), as
        messages (header, transfer), until the final model. Raises :class:`Refused` before the first
        message for a caller that is not that joined client."""
        self.roster.authorize(client_id, credential)
        seq = 0
        while True:
            d = await self._next_delivery(client_id, seq)
            seq = d.seq
            p = d.publication
            yield pb.BroadcastMessage(
                header=pb.BroadcastHeader(
                    run_id=self.run_id,
                    round=p.version,
                    final=p.final,
                    train=d.train,
                    adapt=d.adapt,
                    upload_delta=self.strategy.uploads_are_deltas,
                    asynchronous=not self.strategy.lock_step,
                    num_tensors=len(self.model.manifest),
                    total_bytes=self.model.nbytes,
                )
            )
            for i, m in enumerate(p.messages):
                yield m
                # the final model streams to every client at once: each message is progress, once per
                # client (a client that subscribes again and again cannot keep the server waiting)
                if p.final and i >= self.final_sent.get(client_id, 0):
                    self.final_sent[client_id] = i + 1
                    self.final_messages += 1
            self.bytes_down += p.nbytes
            if p.final:
                return

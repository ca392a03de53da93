"""An in-process transport: a client talks to a :class:`~wafl.server.engine.RoundEngine` in the
same event loop, through the very code paths the gRPC service uses.

Joins, reports and the broadcast stream call the engine directly; the broadcast's pre-encoded
chunk messages are decoded by the same wire decoder a networked client uses, and an upload's
messages (written by the same :func:`~wafl.client.hosting.upload_messages`) go through
:func:`~wafl.server.upload.receive_upload` without being serialized. Only sockets are missing,
so an in-process run and a networked one of the same seeded configuration build the same models.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import structlog
import torch
from wafl.client.hosting import (
    ModelAssembler,
    ReceivedModel,
    SharedReception,
    report_request,
    upload_header,
    upload_messages,
)
from wafl.common.errors import AlreadyAccepted, Code, Refused
from wafl.common.knowledge import Knowledge
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import PreEncoded, decode_broadcast
from wafl.server.engine import RoundEngine
from wafl.server.upload import receive_upload

log = structlog.get_logger("client")

# refusals after which an upload is lost for good (the round moved on, or it was a duplicate)
LOST = {Code.FAILED_PRECONDITION, Code.ABORTED, Code.ALREADY_EXISTS}


class LocalSession:
    def __init__(
        self,
        engine: RoundEngine,
        client_id: str,
        client_index: int,
        num_samples: int,
        reception: SharedReception | None = None,
    ) -> None:
        """``reception``: shared by the sessions of one process, so that a broadcast every client
        receives alike is held (and decoded) once, as in a worker process."""
        self.engine = engine
        self.reception = reception
        self.client_id = client_id
        self.client_index = client_index
        self.num_samples = num_samples
        self.credential = ""
        self.on_header: Callable[[], None] | None = None  # called as each broadcast's header arrives

    def join(self, returning: bool = False) -> pb.JoinReply:
        """Joins the engine. ``returning``: the engine was resumed from a checkpoint that registered this
        client, whose index stays its own: the session presents the credential the engine issues that client."""
        if returning:
            self.credential = self.engine.roster.credentials.issue(self.client_id, self.client_index)
        req = pb.JoinRequest(
            client_id=self.client_id,
            protocol_version=1,
            client_index=self.client_index,
            num_samples=self.num_samples,
            device="cpu",
            token=self.engine.token,
        )
        reply = self.engine.join(req, self.credential)
        self.credential = reply.session_credential
        return reply

    async def models(self) -> AsyncIterator[ReceivedModel]:
        assembler = ModelAssembler(self.engine.manifest, self.on_header, self.reception)
        async for msg in self.engine.deliveries(self.client_id, self.credential):
            model = assembler.feed(decode_broadcast(msg.data) if isinstance(msg, PreEncoded) else msg)
            if model is not None:
                yield model
                if model.final:
                    return

    async def upload(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        num_samples: int,
        metrics: Mapping[str, float],
        knowledge: Knowledge | None = None,
    ) -> int:
        header = upload_header(self.engine.run_id, round, self.client_id, num_samples, uuid.uuid4().hex, metrics)
        try:
            _, nbytes = await receive_upload(
                self.engine.uploads, upload_messages(header, state, knowledge), self.credential
            )
        except AlreadyAccepted as e:
            return e.nbytes
        except Refused as e:
            if e.code not in LOST:
                raise
            log.warning("upload.refused", round=round, code=e.code.value, details=str(e))
            return 0
        return nbytes

    async def report(
        self, round: int, metrics: Mapping[str, float], timeline: list[Any] | None = None, start_unix: float = 0.0
    ) -> None:
        req = report_request(self.engine.run_id, self.client_id, round, metrics, timeline, start_unix)
        self.engine.report(req, self.credential)

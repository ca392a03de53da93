"""Who takes part in the run: the Join of each client (its index, its session credential), the check of that
credential on every later call, and the clients joined so far (training clients go to the strategy; new
clients, :mod:`wafl.common.heterogeneity`, never train)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass

import structlog
from wafl.common.config import RunConfig
from wafl.common.contract import CREDENTIAL_KEY
from wafl.common.errors import Code, Refused
from wafl.common.proto import federation_pb2 as pb
from wafl.server.auth import Credentials, JoinSecrets, Presence, check_id
from wafl.server.strategies import Strategy

log = structlog.get_logger("server")


@dataclass
class ClientInfo:
    client_id: str
    index: int
    num_samples: int


class Roster:
    """The joined clients and their indices. ``index_owner`` (the client id that owns each index) and the
    session epochs of ``credentials`` are what a checkpoint keeps of it; ``presence`` says whether each
    index's session is live (a Join without its credential may not take a live one)."""

    def __init__(
        self,
        cfg: RunConfig,
        secrets: JoinSecrets,
        credentials: Credentials,
        presence: Presence,
        strategy: Strategy,
        shard_sizes: list[int],
        new_indices: Collection[int],
        index_owner: dict[int, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.secrets = secrets
        self.credentials = credentials
        self.presence = presence
        self.strategy = strategy
        self.shard_sizes = shard_sizes  # each index's training-set size: its aggregation weight
        self.new_indices = new_indices
        self.clients: dict[str, ClientInfo] = {}
        # new clients (wafl.common.heterogeneity): joined, never in the strategy, sent each evaluated model
        self.new_clients: set[str] = set()
        self.index_owner: dict[int, str] = {} if index_owner is None else index_owner
        self.all_joined = asyncio.Event()
        self.client_joined = asyncio.Event()  # a training client joined (the wait after a resume watches it)

    @property
    def index_epoch(self) -> dict[int, int]:
        """Sessions that replaced an earlier one, per index (:class:`~wafl.server.auth.Credentials`)."""
        return self.credentials.epochs

    def join(self, req: pb.JoinRequest, credential: str = "") -> str:
        """Registers (or re-registers) a client and returns its session credential ("" for a Join that only
        asks for the configuration); raises :class:`Refused`. A registered index re-joins with its credential,
        its enrollment secret, or, once its session is not live (:class:`~wafl.server.auth.Presence`: gone,
        or never confirmed because the Join's reply was lost), with the token by the same client id, which
        starts a new session whose credential replaces the old one's."""
        check_id("client_id", req.client_id)
        resumes = bool(credential) and self.credentials.index_of(credential, req.client_id) == req.client_index
        # the secret first: an index out of range gets the answer of a bad secret, so that only a
        # caller who may join learns the range (num_clients)
        if not resumes and not self.secrets.admits(req.client_index, req.token):
            what = "enrollment secret of this client_index" if self.secrets.enrollment else "token"
            raise Refused(f"bad or missing {what}", Code.UNAUTHENTICATED)
        if not 0 <= req.client_index < self.cfg.federation.num_clients:
            raise Refused(f"client_index {req.client_index} is outside 0..{self.cfg.federation.num_clients - 1}")
        owner = self.index_owner.get(req.client_index)
        if owner is not None and owner != req.client_id:
            raise Refused(f"client_index {req.client_index} already belongs to another client", Code.ALREADY_EXISTS)
        live = owner is not None and self.presence.live(req.client_index, time.monotonic())
        if live and not resumes and not self.secrets.enrollment and req.num_samples > 0:
            raise Refused(
                f"client_index {req.client_index} is registered and its session is live: re-join with its session "
                f"credential (metadata {CREDENTIAL_KEY!r}), or once it has been gone for {self.presence.grace_s:g} s",
                Code.PERMISSION_DENIED,
            )
        if req.num_samples < 0:
            raise Refused(f"num_samples {req.num_samples} must be positive (or 0 to ask for the configuration only)")
        issued = ""
        if req.num_samples > 0:
            rejoin = req.client_id in self.clients
            samples = self.shard_sizes[req.client_index]  # what it declared plays no part
            self.clients[req.client_id] = ClientInfo(req.client_id, req.client_index, samples)
            self.index_owner[req.client_index] = req.client_id
            if req.client_index in self.new_indices:
                self.new_clients.add(req.client_id)  # it waits for the evaluated models: never selected
            else:
                self.strategy.join(req.client_id, req.client_index, samples)
                self.client_joined.set()
            if resumes:
                self.presence.seen(req.client_index, time.monotonic())
            else:  # a new session; by the token, the one before it (if any) no longer speaks for the index
                if owner is not None and not self.secrets.enrollment:
                    self.credentials.renew(req.client_index)
                self.presence.fresh(req.client_index)
            issued = self.credentials.issue(req.client_id, req.client_index)
            log.info(
                "client.join",
                client=req.client_id,
                index=req.client_index,
                samples=req.num_samples,
                device=req.device[:64],
                rejoin=rejoin,
                joined=len(self.clients),
            )
            if len(self.clients) >= self.cfg.federation.num_clients:
                self.all_joined.set()
        return issued

    def authorize(self, client_id: str, credential: str) -> None:
        """Checks that ``credential`` is the session credential of the joined client ``client_id``;
        raises :class:`Refused` (UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND)."""
        check_id("client_id", client_id)
        index = self.credentials.check(credential, client_id, self.index_owner.get)
        if client_id not in self.clients:
            raise Refused(f"unknown client_id {client_id!r}: call Join first", Code.NOT_FOUND)
        self.presence.seen(index, time.monotonic())

    def credential_holder(self, credential: str) -> int:
        """The index of the registered client a session credential belongs to; raises :class:`Refused`."""
        return self.credentials.holder(credential, self.index_owner.get)

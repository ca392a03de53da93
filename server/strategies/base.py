"""What every round policy is: the :class:`Strategy` interface the engine calls, the
:class:`Collection` of updates that becomes the next version, and the registry of rules.

Transport-free: no gRPC, no asyncio, no clock of its own. The engine (``engine.py``: its round loop,
roster and upload registry) calls these methods from its event loop with the current time, runs
:meth:`Strategy.aggregate` in a worker thread, and does every transfer; the in-process simulation
drives the very same engine.

A :class:`Collection` gathers the updates of the next version: a streaming weighted sum
(:class:`~wafl.server.aggregation.accumulator.Accumulator`), the knowledge, the metrics. A rule is one file
of this package (``sync.py``, ``buffered.py``, ``fedasync.py``): a subclass decorated with
:func:`register` under the name ``aggregation = "name"`` selects, with a configuration dataclass
(:attr:`Strategy.Config`) that reads and checks the rule's settings (its fields of the run
configuration and its ``aggregation_params``). The registry :data:`STRATEGIES`
(a :class:`~wafl.common.registry.Registry`) imports every module of the package the first time it is
read, so nothing else names a rule. What a client must know about the rule travels on the wire from the
class attributes (:attr:`Strategy.uploads_are_deltas` and :attr:`Strategy.lock_step` in every
broadcast header), not as a test of the configuration's ``aggregation`` string.
"""

from __future__ import annotations

import copy
import enum
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias, TypeVar

import torch
from wafl.common import metrics as M
from wafl.common.algorithms.base import Algorithm
from wafl.common.config import ConfigError, RunConfig
from wafl.common.errors import AlreadyAccepted, Code, InvariantError, Refused
from wafl.common.knowledge import Knowledge, KnowledgeAccumulator
from wafl.common.registry import Registry
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.results import weighted_mean

State: TypeAlias = "OrderedDict[str, torch.Tensor]"
Deliveries = dict[str, bool]  # client id -> asked to train on the model it is sent


class Drain(enum.StrEnum):
    """What the engine does with uploads still streaming into a collection that closes."""

    CANCEL = "cancel"  # they are rolled back (the client may retry into a later collection)
    WAIT = "wait"  # they may finish into it, for up to ``round_deadline_s``


@dataclass
class Collection:
    """The updates gathered for one new version."""

    version: int  # the version it is built from (sync: the round); the results row's ``round``
    accumulator: Accumulator
    knowledge: KnowledgeAccumulator | None
    opened_at: float
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # committed client -> upload metrics
    staleness: list[int] = field(default_factory=list)
    samples: float = 0.0  # sum of the committed uploads' sample counts
    samples_of: dict[str, int] = field(default_factory=dict)  # committed client -> its upload's num_samples
    bytes_up: int = 0
    in_flight: dict[str, Ticket] = field(default_factory=dict)
    closed: bool = False


@dataclass
class Ticket:
    """One admitted upload: who, from which version, with which fold weight, into which collection."""

    client_id: str
    version: int  # the version it was trained from (its header's ``round``)
    key: str
    samples: int
    weight: float
    staleness: int
    collection: Collection


@dataclass
class ClientSlot:
    client_id: str
    index: int
    num_samples: int


@dataclass(frozen=True)
class RuleConfig:
    """A rule's settings, read from the run configuration by :meth:`of`, which raises
    :class:`~wafl.common.config.ConfigError` naming the bad field. The base reads nothing and
    refuses any ``aggregation_params`` (a rule with settings of its own declares them)."""

    #: the rule's own settings in ``aggregation_params``, with their defaults
    PARAMS: ClassVar[dict[str, Any]] = {}

    @classmethod
    def of(cls, cfg: RunConfig) -> RuleConfig:
        cls.own_params(cfg)
        return cls()

    @classmethod
    def own_params(cls, cfg: RunConfig) -> dict[str, Any]:
        """``aggregation_params`` over :attr:`PARAMS`' defaults; an unknown name is refused."""
        unknown = sorted(set(cfg.rule.aggregation_params) - set(cls.PARAMS))
        if unknown:
            known = ", ".join(sorted(cls.PARAMS)) or "none"
            raise ConfigError(
                f"aggregation_params.{unknown[0]} is not a setting of aggregation={cfg.rule.aggregation!r} "
                f"(its settings: {known})"
            )
        return {**cls.PARAMS, **cfg.rule.aggregation_params}

    def uploads_per_aggregation(self, cfg: RunConfig) -> int:
        """The uploads one aggregation nominally combines (the robust aggregators' minimum counts)."""
        return cfg.federation.training_clients


class Strategy(ABC):
    """The round policy the engine runs; see the module docstring."""

    #: the rule's name (``aggregation = "name"``), set by :func:`register`
    name: ClassVar[str] = ""

    #: the rule's settings (:meth:`RuleConfig.of` reads and checks them)
    Config: ClassVar[type[RuleConfig]] = RuleConfig

    #: whether uploads are differences to the model they were trained from (else whole models);
    #: every broadcast header says so (``BroadcastHeader.upload_delta``), so clients never ask the configuration
    uploads_are_deltas: ClassVar[bool] = False

    #: whether rounds are lock-step, every client of a round training on one version (sync). Clients then
    #: evaluate their models only in the rounds the global model is evaluated (``RunConfig.evaluates_locally``);
    #: under a rule that is not, every time, since an upload's round is not its results line's. Every broadcast
    #: header says so (``BroadcastHeader.asynchronous`` is its negation), so clients never ask the configuration
    lock_step: ClassVar[bool] = True

    #: whether clients train on different versions at once: a results line then does not wait for
    #: the PM reports of its round, and its ``pm_accuracy`` is the mean of each client's latest report
    latest_pm: ClassVar[bool] = False

    #: what the engine does with uploads still streaming into a collection that closes
    drain: ClassVar[Drain] = Drain.CANCEL

    def __init__(
        self, cfg: RunConfig, algorithm: Algorithm, num_classes: int, new_accumulator: Callable[[], Accumulator]
    ) -> None:
        self.cfg = cfg
        self.algorithm = algorithm
        self.num_classes = num_classes
        self.new_accumulator = new_accumulator
        self.clients: dict[str, ClientSlot] = {}
        # (client, version trained from) -> (idempotency key, bytes, version of the collection it went into)
        self.accepted: dict[tuple[str, int], tuple[str, int, int]] = {}
        self.version = 1  # the newest published version: 1, the initial model, then one more per aggregation
        self.current: Collection | None = None  # the collection uploads fold into now; None before start

    @classmethod
    def check_config(cls, cfg: RunConfig) -> RuleConfig:
        """The rule's settings; raises ``ConfigError`` for a configuration this policy cannot run
        (called by :func:`wafl.server.strategies.check_aggregation`)."""
        return cls.Config.of(cfg)

    # ------------------------------------------------------------------ clients and versions
    def join(self, client_id: str, index: int, num_samples: int) -> None:
        self.clients[client_id] = ClientSlot(client_id, index, num_samples)

    @property
    def done(self) -> bool:
        """Whether ``rounds`` versions were built (the newest is version ``rounds + 1``)."""
        return self.version > self.cfg.federation.rounds

    def resume(self, version: int) -> None:
        """Goes on from ``version``, the newest one a checkpoint holds."""
        self.version = version

    def _collection(self, version: int, now: float) -> Collection:
        know = (
            KnowledgeAccumulator(self.num_classes, uniform=self.algorithm.knowledge_weighting == "uniform")
            if self.algorithm.knowledge is not None
            else None
        )
        return Collection(version, self.new_accumulator(), know, opened_at=now)

    def collecting(self) -> Collection:
        """The collection uploads fold into now; raises :class:`InvariantError` before :meth:`start`."""
        if self.current is None:
            raise InvariantError(f"aggregation={self.name!r}: no collection is open (start was not called)")
        return self.current

    @abstractmethod
    def start(self, now: float) -> Deliveries:
        """Every client has joined: who receives the current version, and who trains on it."""

    @abstractmethod
    def published(self, now: float) -> Deliveries:
        """A new version was published: who receives it, and who trains on it."""

    # ------------------------------------------------------------------ uploads
    def check_retry(self, client_id: str, version: int, key: str) -> None:
        """Raises :class:`AlreadyAccepted` when ``key`` names this client's committed upload trained
        from ``version``: a retry is answered with the original outcome for the rest of the run."""
        done = self.accepted.get((client_id, version))
        if done is not None and key and done[0] == key:
            raise AlreadyAccepted(version, done[1])

    def open(
        self,
        client_id: str,
        version: int,
        num_samples: int,
        key: str,
        now: float,
        metrics: Mapping[str, float] | None = None,
    ) -> Ticket:
        """Admits an upload's header (``version``: the version it was trained from, the header's ``round``)
        or raises :class:`Refused` (:class:`AlreadyAccepted` for a retry); ``metrics`` are the header's
        declared metrics (its ``train_steps``, ...), which the fold weight sees."""
        self.check_retry(client_id, version, key)
        done = self.accepted.get((client_id, version))
        collection, staleness = self._admit(client_id, version, now)
        if done is not None:
            raise Refused(f"client {client_id!r} already uploaded for round {version}", Code.ALREADY_EXISTS)
        slot = self.clients[client_id]
        if not 0 < num_samples <= slot.num_samples:
            raise Refused(f"num_samples {num_samples} must lie in 1..{slot.num_samples} (declared at Join)")
        for c in (collection, *self._open_collections()):
            if client_id in c.in_flight:
                raise Refused(
                    f"an upload from client {client_id!r} for round {version} is already streaming", Code.ALREADY_EXISTS
                )
        weight = self.fold_weight(num_samples, metrics or {}, staleness)
        ticket = Ticket(client_id, version, key, num_samples, weight, staleness, collection)
        collection.in_flight[client_id] = ticket
        return ticket

    def _open_collections(self) -> tuple[Collection, ...]:
        return ()

    def fold_weight(self, num_samples: int, metrics: Mapping[str, float], staleness: int) -> float:
        """An admitted upload's weight in the collection's sum: the algorithm's (sample count, or what
        its declared metrics say) times the rule's weight for its age."""
        return self.algorithm.server.weight(num_samples, metrics) * self.staleness_weight(staleness)

    def staleness_weight(self, staleness: int) -> float:
        return 1.0

    @abstractmethod
    def _admit(self, client_id: str, version: int, now: float) -> tuple[Collection, int]:
        """The collection an upload trained from ``version`` folds into and its staleness, or :class:`Refused`."""

    def commit(
        self, ticket: Ticket, metrics: Mapping[str, float], knowledge: Knowledge | None, nbytes: int, now: float
    ) -> Deliveries:
        """Records a complete, checked upload whose fold was committed; returns new work to hand out."""
        c = ticket.collection
        c.in_flight.pop(ticket.client_id, None)
        c.metrics[ticket.client_id] = dict(metrics)
        c.staleness.append(ticket.staleness)
        c.samples += ticket.samples
        c.samples_of[ticket.client_id] = ticket.samples
        c.bytes_up += nbytes
        if c.knowledge is not None and knowledge:
            c.knowledge.add(knowledge)
        self.accepted[(ticket.client_id, ticket.version)] = (ticket.key, nbytes, c.version)
        return self._freed(ticket.client_id, now)

    def committed_uploads(self) -> list[list[Any]]:
        """The committed uploads of the versions built so far, ``[client, version, key, bytes]`` each
        (plain values for a checkpoint), so that a resumed server answers their retries as before."""
        return [[cid, v, key, n] for (cid, v), (key, n, into) in self.accepted.items() if into < self.version]

    def restore_uploads(self, entries: list[list[Any]]) -> None:
        """Takes :meth:`committed_uploads` back after a resume; raises ``ValueError`` for a malformed entry."""
        for entry in entries:
            cid, v, key, n = entry
            if not (isinstance(cid, str) and isinstance(key, str) and isinstance(v, int) and isinstance(n, int)):
                raise ValueError(f"malformed committed upload {entry!r}")
            self.accepted[(cid, v)] = (key, n, 0)

    def release(self, ticket: Ticket) -> None:
        """An admitted upload failed (it was rolled back); the client may retry."""
        ticket.collection.in_flight.pop(ticket.client_id, None)

    def _freed(self, client_id: str, now: float) -> Deliveries:
        return {}

    # ------------------------------------------------------------------ closing a version
    @abstractmethod
    def ready(self) -> bool:
        """Whether the current collection should close now."""

    def tick(self, now: float) -> Deliveries:
        """Time passed (deadlines); returns new work to hand out. May raise :class:`RunAborted`."""
        return {}

    def next_deadline(self) -> float | None:
        return None

    @abstractmethod
    def close(self, now: float) -> Collection:
        """Closes the current collection (no new upload enters it) and returns it."""

    @abstractmethod
    def combine(self, prev: State, collection: Collection) -> dict[str, torch.Tensor]:
        """The next global model from the previous one and a closed collection (worker thread)."""

    def aggregate(self, prev: State, collection: Collection) -> tuple[State | None, Knowledge | None, dict[str, Any]]:
        """``(next model or None when nothing was committed, next knowledge or None, row fields)``; the
        next version's number is taken whatever it holds (the previous model again, when None)."""
        self.version += 1
        row = self.row(collection)
        if collection.accumulator.count == 0:
            return None, None, row
        saved = copy.deepcopy(self.algorithm.server.state_dict())
        new = self.combine(prev, collection)
        state = OrderedDict((k, new[k].detach().to(v.dtype).contiguous()) for k, v in prev.items())
        bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:  # never published: the previous model (and server state) stay
            self.algorithm.server.load_state_dict(saved)
            row["refused"] = f"non-finite next model ({len(bad)} tensors, first {bad[0]!r})"
            return None, None, row
        knowledge = collection.knowledge.result() if collection.knowledge is not None else None
        return state, knowledge, row

    def row(self, c: Collection) -> dict[str, Any]:
        """The results fields the policy owns."""
        # a mean loss over samples: each upload's mean weighted by its num_samples
        losses = [(c.samples_of[cid], m[M.TRAIN_LOSS]) for cid, m in c.metrics.items() if M.TRAIN_LOSS in m]
        samples = sum(n for n, _ in losses)
        row: dict[str, Any] = {
            "round": c.version,
            "clients": c.accumulator.count,
            "bytes_up": c.bytes_up,
            "train_loss": sum(n * loss for n, loss in losses) / samples if samples else None,
        }
        if self.algorithm.knowledge is not None:
            got = [m[M.KNOWLEDGE_RECEIVED] for m in c.metrics.values() if M.KNOWLEDGE_RECEIVED in m]
            row["knowledge_received_min"] = min(got) if got else None
        if self.algorithm.personal == "none" or self.algorithm.local_model_is_personal:
            row["local_accuracy"] = local_accuracy(c.metrics.values(), self.algorithm.local_model_is_personal)
        return row

    def expected_reports(self, c: Collection) -> set[str]:
        """Clients whose PM report for this row's round the results line waits for."""
        return set()

    def evaluates_locally(self, version: int) -> bool:
        """Whether the clients that train on ``version`` evaluate their models on their local test sets
        (:attr:`lock_step`, ``RunConfig.evaluates_locally``): what the clients decide from the header."""
        return self.cfg.evaluates_locally(version, self.lock_step)


def local_accuracy(uploads: Iterable[Mapping[str, float]], personal: bool) -> float | None:
    """The accuracy of the models the clients just trained, on their local test sets, weighted by
    each test set's size: what the uploads' ``local_accuracy`` say (``pm_accuracy`` where the
    local model is the personal one); None when no upload says."""
    acc, weight = (M.PM_ACCURACY, M.PM_TEST_SAMPLES) if personal else (M.LOCAL_ACCURACY, M.LOCAL_TEST_SAMPLES)
    return weighted_mean((m.get(weight, 1.0), m[acc]) for m in uploads if acc in m)


S = TypeVar("S", bound=type[Strategy])

# by the configuration's ``aggregation``; each file of this package registers its rule (@register)
STRATEGIES: Registry[type[Strategy]] = Registry("aggregation", "wafl.server.strategies")


def register(name: str) -> Callable[[S], S]:
    """Class decorator: the rule is ``aggregation = name`` (in :data:`STRATEGIES`; a name claimed twice is
    refused), and its :attr:`Strategy.name` is ``name``."""

    def add(cls: S) -> S:
        STRATEGIES.add(name, cls)
        cls.name = name
        return cls

    return add

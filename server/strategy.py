"""Round policies: who trains on which model version, what becomes of each update, when the next
version is published, and how the gathered updates become it.

Transport-free: no gRPC, no asyncio, no clock of its own. The engine (``engine.py``) calls these
methods from its event loop with the current time, runs :meth:`Strategy.aggregate` in a worker
thread, and does every transfer; the in-process simulation drives the very same engine.

A :class:`Collection` gathers the updates of the next version: a streaming weighted sum
(:class:`~wafl.server.aggregator.Accumulator`), the knowledge, the metrics. Two policies:

* :class:`SyncStrategy`: lock-step rounds. Round ``r`` selects clients (a fraction or an
  activation probability); version ``r`` goes to the clients that do something with it: the
  selected ones, which train on it, every client when the algorithm trains the personal part of
  unselected clients (``pm_when_unselected``), and, for an algorithm with a personal phase, the
  clients selected in round ``r - 1``, whose PM phase ends at this broadcast and is evaluated
  after it (``broadcast_all`` sends it to every client);
  the round closes when every selected client uploaded or its deadline passed with
  ``min_clients`` uploads (a deadline with fewer is extended ``max_round_retries`` times); uploads
  still streaming then are rolled back. The algorithm's server update turns the weighted mean
  of the models into version ``r + 1``.
* :class:`BufferedStrategy`: buffered asynchronous aggregation (FedBuff, Nguyen et al., AISTATS
  2022). Up to ``concurrency`` clients train at once, each on the newest version when it was
  asked; each upload is a delta against the version it started from, weighted by
  ``staleness(age in versions) * samples``; ``buffer_size`` accepted deltas (plus any already
  streaming into the buffer when it filled) make the next version,
  ``x + server_lr * sum_i s(age_i) n_i delta_i / sum_i n_i``. Freed slots go at once to idle
  clients chosen at random (reproducibly from the seed), with the newest version.

A new rule is one subclass here, named in :data:`STRATEGIES` (``aggregation = "name"``): the
engine only calls the methods of :class:`Strategy`, and the configuration asks the class
(:meth:`Strategy.check_config`, registered with the configuration) what it refuses.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import torch
from wafl.common import metrics as M
from wafl.common.algorithms.base import Algorithm
from wafl.common.config import ConfigError, RunConfig, register_config_check
from wafl.common.errors import AlreadyAccepted, Code, Refused
from wafl.common.knowledge import Knowledge, KnowledgeAccumulator
from wafl.server.aggregator import Accumulator
from wafl.server.results import weighted_mean
from wafl.server.selection import select_clients

State: TypeAlias = "OrderedDict[str, torch.Tensor]"
Deliveries = dict[str, bool]  # client id -> asked to train on the model it is sent


class RunAborted(RuntimeError):
    """The run cannot go on (no client uploaded for too long); the message says why."""


@dataclass
class Collection:
    """The updates gathered for one new version."""

    number: int  # the results row's round: the version it is built from (sync: the round)
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
    round: int
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


class Strategy(ABC):
    """The round policy the engine runs; see the module docstring."""

    #: whether uploads are differences to the model they were trained from (else whole models)
    uploads_are_deltas: bool = False

    #: what the engine does with uploads still streaming into a collection that closes:
    #: "cancel" rolls them back, "wait" lets them finish into it
    drain: str = "cancel"

    def __init__(
        self, cfg: RunConfig, algorithm: Algorithm, num_classes: int, new_accumulator: Callable[[], Accumulator]
    ) -> None:
        self.cfg = cfg
        self.algorithm = algorithm
        self.num_classes = num_classes
        self.new_accumulator = new_accumulator
        self.clients: dict[str, ClientSlot] = {}
        # (client, round) -> (idempotency key, bytes, number of the collection it went into)
        self.accepted: dict[tuple[str, int], tuple[str, int, int]] = {}
        self.aggregations = 0  # versions built so far (the initial model is version 1)

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Refuses (``ConfigError``) configurations this policy cannot run; called by ``RunConfig.validate``."""

    # ------------------------------------------------------------------ clients and versions
    def join(self, client_id: str, index: int, num_samples: int) -> None:
        self.clients[client_id] = ClientSlot(client_id, index, num_samples)

    @property
    def version(self) -> int:
        """The newest published version (1: the initial model)."""
        return self.aggregations + 1

    @property
    def done(self) -> bool:
        return self.aggregations >= self.cfg.rounds

    def resume(self, aggregations: int) -> None:
        self.aggregations = aggregations

    def _collection(self, number: int, now: float) -> Collection:
        know = (
            KnowledgeAccumulator(self.num_classes, uniform=self.algorithm.knowledge_weighting == "uniform")
            if self.algorithm.knowledge is not None
            else None
        )
        return Collection(number, self.new_accumulator(), know, opened_at=now)

    @abstractmethod
    def start(self, now: float) -> Deliveries:
        """Every client has joined: who receives the current version, and who trains on it."""

    @abstractmethod
    def published(self, now: float) -> Deliveries:
        """A new version was published: who receives it, and who trains on it."""

    # ------------------------------------------------------------------ uploads
    def check_retry(self, client_id: str, round: int, key: str) -> None:
        """Raises :class:`AlreadyAccepted` when ``key`` names this client's committed upload for
        ``round``: a retry is answered with the original outcome for the rest of the run."""
        done = self.accepted.get((client_id, round))
        if done is not None and key and done[0] == key:
            raise AlreadyAccepted(round, done[1])

    def open(self, client_id: str, round: int, num_samples: int, key: str, now: float) -> Ticket:
        """Admits an upload's header or raises :class:`Refused` (:class:`AlreadyAccepted` for a retry)."""
        self.check_retry(client_id, round, key)
        done = self.accepted.get((client_id, round))
        collection, staleness = self._admit(client_id, round, now)
        if done is not None:
            raise Refused(f"client {client_id!r} already uploaded for round {round}", Code.ALREADY_EXISTS)
        slot = self.clients[client_id]
        if not 0 < num_samples <= slot.num_samples:
            raise Refused(f"num_samples {num_samples} must lie in 1..{slot.num_samples} (declared at Join)")
        for c in (collection, *self._open_collections()):
            if client_id in c.in_flight:
                raise Refused(
                    f"an upload from client {client_id!r} for round {round} is already streaming", Code.ALREADY_EXISTS
                )
        weight = self.algorithm.server.weight(num_samples) * self.staleness_weight(staleness)
        ticket = Ticket(client_id, round, key, num_samples, weight, staleness, collection)
        collection.in_flight[client_id] = ticket
        return ticket

    def _open_collections(self) -> tuple[Collection, ...]:
        return ()

    def staleness_weight(self, staleness: int) -> float:
        return 1.0

    @abstractmethod
    def _admit(self, client_id: str, round: int, now: float) -> tuple[Collection, int]:
        """The collection an upload from ``round`` folds into and its staleness, or :class:`Refused`."""

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
        self.accepted[(ticket.client_id, ticket.round)] = (ticket.key, nbytes, c.number)
        return self._freed(ticket.client_id, now)

    def committed_uploads(self) -> list[list[Any]]:
        """The committed uploads of the versions built so far, ``[client, round, key, bytes]`` each
        (plain values for a checkpoint), so that a resumed server answers their retries as before."""
        return [[cid, r, key, n] for (cid, r), (key, n, number) in self.accepted.items() if number <= self.aggregations]

    def restore_uploads(self, entries: list[list[Any]]) -> None:
        """Takes :meth:`committed_uploads` back after a resume; raises ``ValueError`` for a malformed entry."""
        for entry in entries:
            cid, r, key, n = entry
            if not (isinstance(cid, str) and isinstance(key, str) and isinstance(r, int) and isinstance(n, int)):
                raise ValueError(f"malformed committed upload {entry!r}")
            self.accepted[(cid, r)] = (key, n, 0)

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
        """``(next model or None when nothing was committed, next knowledge or None, row fields)``."""
        self.aggregations += 1
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
            "round": c.number,
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

    def state_dict(self) -> dict[str, Any]:
        return {"aggregations": self.aggregations}


def local_accuracy(uploads: Iterable[Mapping[str, float]], personal: bool) -> float | None:
    """The accuracy of the models the clients just trained, on their local test sets, weighted by
    each test set's size: what the uploads' ``local_accuracy`` say (``pm_accuracy`` where the
    local model is the personal one); None when no upload says."""
    acc, weight = (M.PM_ACCURACY, M.PM_TEST_SAMPLES) if personal else (M.LOCAL_ACCURACY, M.LOCAL_TEST_SAMPLES)
    return weighted_mean((m.get(weight, 1.0), m[acc]) for m in uploads if acc in m)


class SyncStrategy(Strategy):
    drain = "cancel"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.current: Collection | None = None
        self.selected: set[str] = set()
        self.deadline = math.inf
        self.extensions = 0
        self.short = False  # the deadline passed with enough uploads

    @property
    def round(self) -> int:
        return self.version

    def _open_round(self, now: float) -> Deliveries:
        r = self.round
        ids = [c.client_id for c in sorted(self.clients.values(), key=lambda c: c.index)]
        self.selected = select_clients(self.cfg.seed, r, ids, self.cfg.fraction, self.cfg.act_prob)
        self.current = self._collection(r, now)
        self.deadline = now + self.cfg.round_deadline_s
        self.extensions = 0
        self.short = False
        return {c: c in self.selected for c in self._recipients(r, ids)}

    def _recipients(self, r: int, ids: list[str]) -> list[str]:
        """Who is sent model ``r`` (module docstring): an unselected client that neither trains its
        personal part on it nor ends a PM phase with it would only discard it."""
        a = self.algorithm
        if self.cfg.broadcast_all or (a.personalized and a.pm_when_unselected):
            return ids
        keep = self.selected
        if a.personalized and r > 1:  # a pure function of the seed: the same after --resume
            keep = keep | select_clients(self.cfg.seed, r - 1, ids, self.cfg.fraction, self.cfg.act_prob)
        return [c for c in ids if c in keep]

    def start(self, now: float) -> Deliveries:
        return self._open_round(now)

    def published(self, now: float) -> Deliveries:
        return {} if self.done else self._open_round(now)

    def _admit(self, client_id: str, round: int, now: float) -> tuple[Collection, int]:
        c = self.current
        if c is None or self.done:
            raise Refused("no round is open", Code.FAILED_PRECONDITION)
        if round < c.number or (round == c.number and c.closed):
            raise Refused(f"round {round} is closed; the current round is {c.number}", Code.FAILED_PRECONDITION)
        if round > c.number:
            raise Refused(f"round {round} has not opened; the current round is {c.number}", Code.FAILED_PRECONDITION)
        if client_id not in self.selected:
            raise Refused(f"client {client_id!r} is not selected for round {round}", Code.FAILED_PRECONDITION)
        return c, 0

    def ready(self) -> bool:
        assert self.current is not None
        # only selected clients commit into the round (``_admit``): counting them is enough
        return self.short or len(self.current.metrics) >= len(self.selected)

    def next_deadline(self) -> float | None:
        return self.deadline

    def tick(self, now: float) -> Deliveries:
        c = self.current
        if c is None or now < self.deadline or self.ready():
            return {}
        got = len(c.metrics)
        min_clients = min(self.cfg.min_clients or 1, len(self.selected))
        if got >= min_clients or (got and self.extensions >= self.cfg.max_round_retries):
            self.short = True
            return {}
        if self.extensions >= self.cfg.max_round_retries:
            raise RunAborted(
                f"round {c.number}: no client uploaded within {self.extensions + 1} deadlines of "
                f"{self.cfg.round_deadline_s}s"
            )
        self.extensions += 1
        self.deadline = now + self.cfg.round_deadline_s
        return {}

    def close(self, now: float) -> Collection:
        assert self.current is not None
        self.current.closed = True
        return self.current

    def combine(self, prev: State, collection: Collection) -> dict[str, torch.Tensor]:
        acc = collection.accumulator
        return self.algorithm.server.finalize(prev, acc.center(), acc.count)

    def row(self, c: Collection) -> dict[str, Any]:
        return {**super().row(c), "selected": len(self.selected)}

    def expected_reports(self, c: Collection) -> set[str]:
        """The clients that trained their PM in this round: those that uploaded and, for an algorithm
        whose unselected clients train their personal part too, every client not selected."""
        if self.algorithm.personalized and not self.algorithm.local_model_is_personal:
            unselected = set(self.clients) - self.selected if self.algorithm.pm_when_unselected else set()
            return set(c.metrics) | unselected
        return set()


def staleness_function(cfg: RunConfig) -> Callable[[int], float]:
    """The weight of an update ``s`` versions old (FedBuff's choices)."""
    a, b = cfg.staleness_a, cfg.staleness_b
    return {
        "sqrt": lambda s: 1.0 / math.sqrt(1.0 + s),
        "constant": lambda s: 1.0,
        "poly": lambda s: (1.0 + s) ** -a,
        "hinge": lambda s: 1.0 if s <= b else 1.0 / (a * (s - b) + 1.0),
    }[cfg.staleness]


class BufferedStrategy(Strategy):
    drain = "wait"
    uploads_are_deltas = True

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        if cfg.fraction != 1.0 or cfg.act_prob is not None or cfg.min_clients is not None:
            raise ConfigError(
                "fraction, act_prob and min_clients apply to aggregation='sync'; "
                "buffered aggregation sets how many clients train at once with concurrency"
            )
        from wafl.common.algorithms import registry

        try:
            algo = registry.resolve(cfg.algorithm, cfg.params, dataclasses.asdict(cfg))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not algo.server.buffered_ok:
            raise ConfigError(
                f"algorithm={cfg.algorithm!r} does not combine with aggregation='buffered': its server update "
                f"({type(algo.server).__name__}) keeps state built from one round's full models, while buffered "
                "aggregation publishes versions from stale, staleness-weighted deltas"
            )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.concurrency = self.cfg.buffered_concurrency
        self.buffer_size = self.cfg.buffered_size
        self.weight_of = staleness_function(self.cfg)
        self.current: Collection | None = None
        self.closing: list[Collection] = []
        self.assigned: dict[str, tuple[int, float]] = {}  # client -> (version it trains on, when asked)
        self.trained: dict[str, int] = {}  # client -> the version it was last asked to train on
        self.draws = 0

    def _assign(self, now: float) -> Deliveries:
        """Hands free slots to idle clients (random, reproducible), with the newest version; a client
        never trains twice on one version (a slot it frees waits for the next one instead)."""
        out: Deliveries = {}
        if self.done or len(self.assigned) >= self.concurrency:
            return out  # no free slot: nothing to draw (and no pass over every client)
        idle = sorted(
            (
                c
                for c in self.clients.values()
                if c.client_id not in self.assigned and self.trained.get(c.client_id) != self.version
            ),
            key=lambda c: c.index,
        )
        while idle and len(self.assigned) < self.concurrency:
            self.draws += 1
            pick = idle.pop(int(np.random.default_rng([self.cfg.seed, 7, self.draws]).integers(len(idle))))
            self.assigned[pick.client_id] = (self.version, now)
            self.trained[pick.client_id] = self.version
            out[pick.client_id] = True
        return out

    def start(self, now: float) -> Deliveries:
        self.current = self._collection(self.version, now)
        return self._assign(now)

    def published(self, now: float) -> Deliveries:
        return self._assign(now)

    def staleness_weight(self, staleness: int) -> float:
        return self.weight_of(staleness)

    def _open_collections(self) -> tuple[Collection, ...]:
        return tuple(self.closing)

    def _admit(self, client_id: str, round: int, now: float) -> tuple[Collection, int]:
        if self.current is None or self.done:
            raise Refused("no version is being collected", Code.FAILED_PRECONDITION)
        given = self.assigned.get(client_id)
        if given is None or given[0] != round:
            raise Refused(
                f"client {client_id!r} was not asked to train on version {round}"
                + ("" if given is None else f" (it trains on version {given[0]})"),
                Code.FAILED_PRECONDITION,
            )
        staleness = self.version - round
        if staleness > self.cfg.max_staleness:
            self.assigned.pop(client_id, None)
            raise Refused(
                f"an update from version {round} is {staleness} versions old; max_staleness={self.cfg.max_staleness}",
                Code.FAILED_PRECONDITION,
            )
        return self.current, staleness

    def _freed(self, client_id: str, now: float) -> Deliveries:
        self.assigned.pop(client_id, None)
        self._forget_drained()
        return self._assign(now)

    def release(self, ticket: Ticket) -> None:
        super().release(ticket)
        self._forget_drained()

    def _forget_drained(self) -> None:
        self.closing = [c for c in self.closing if c.in_flight]

    def ready(self) -> bool:
        assert self.current is not None
        return len(self.current.metrics) >= self.buffer_size

    def next_deadline(self) -> float | None:
        first = min((t for _, t in self.assigned.values()), default=None)
        return None if first is None else first + self.cfg.round_deadline_s

    def tick(self, now: float) -> Deliveries:
        expired = [c for c, (_, t) in self.assigned.items() if now - t >= self.cfg.round_deadline_s]
        in_flight = {cid for c in (self.current, *self.closing) if c is not None for cid in c.in_flight}
        for cid in expired:
            if cid in in_flight:
                self.assigned[cid] = (self.assigned[cid][0], now)  # streaming: it gets another deadline
            else:
                del self.assigned[cid]  # its slot goes to someone else; a late upload is refused
        return self._assign(now) if expired else {}

    def close(self, now: float) -> Collection:
        assert self.current is not None
        closing = self.current
        closing.closed = True
        if closing.in_flight:
            self.closing.append(closing)
        self.current = self._collection(self.version + 1, now)
        return closing

    def combine(self, prev: State, collection: Collection) -> dict[str, torch.Tensor]:
        acc = collection.accumulator
        if acc.rule.keeps_uploads:  # a robust center of the deltas, unweighted
            mean, scale = acc.center(), self.cfg.server_lr
        else:
            mean = acc.mean()  # sum_i w_i delta_i / sum_i w_i, w_i = s(age_i) n_i
            scale = self.cfg.server_lr * acc.total_weight / collection.samples
        out: dict[str, torch.Tensor] = {}
        for k, x in prev.items():
            step = mean[k].to(torch.float64) * scale
            out[k] = x + (step if x.is_floating_point() else torch.round(step)).to(x.dtype)
        return out

    def row(self, c: Collection) -> dict[str, Any]:
        s = c.staleness
        return {
            **super().row(c),
            "version": c.number + 1,
            "staleness_mean": sum(s) / len(s) if s else None,
            "staleness_max": max(s) if s else None,
        }


STRATEGIES: dict[str, type[Strategy]] = {"sync": SyncStrategy, "buffered": BufferedStrategy}


def check_aggregation(cfg: RunConfig) -> None:
    """The ``aggregation`` section: a known policy, and what that policy refuses (:meth:`Strategy.check_config`)."""
    if cfg.aggregation not in STRATEGIES:
        raise ConfigError(f"aggregation={cfg.aggregation!r} is not one of {sorted(STRATEGIES)}")
    STRATEGIES[cfg.aggregation].check_config(cfg)


register_config_check("aggregation", check_aggregation)


def make_strategy(
    cfg: RunConfig, algorithm: Algorithm, num_classes: int, new_accumulator: Callable[[], Accumulator]
) -> Strategy:
    return STRATEGIES[cfg.aggregation](cfg, algorithm, num_classes, new_accumulator)

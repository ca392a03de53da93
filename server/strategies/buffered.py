"""Buffered asynchronous aggregation (FedBuff: Nguyen et al., "Federated Learning with Buffered
Asynchronous Aggregation", AISTATS 2022).

Up to ``concurrency`` clients train at once, each on the newest version when it was asked; each
upload is a delta ``delta_i`` against the version it started from. ``buffer_size`` accepted deltas
(plus any already streaming into the buffer when it filled) make the next version:

* ``weighting = "uniform"`` (the default; the paper's Algorithm 1 and FLSim's default equal
  example weight): ``x + server_lr * sum_i s(age_i) delta_i / K``, ``K`` the number of deltas in
  the buffer (``buffer_size``; more only when uploads were streaming as it filled);
* ``weighting = "samples"`` (wafl's earlier rule, a departure from the paper, which averages the K
  deltas uniformly): ``x + server_lr * sum_i s(age_i) n_i delta_i / sum_i n_i``, ``n_i`` the
  upload's sample count.

``age_i`` (``t - tau_i`` in the paper) is the versions between the one the update was trained from and
the one its buffer is applied to: an upload that arrives after a buffer closed but before its version is
built goes into the next buffer, which is applied to that new version, so it is already one version old.
``s`` is the run's ``staleness`` function, one file each in :mod:`wafl.server.staleness` (FedBuff's
``sqrt`` ``1/sqrt(1+age)``; FedAsync's ``constant``, ``poly``, ``hinge``). Freed slots go at once to
idle clients chosen at random (reproducibly from the seed), with the newest version; a client is never
given one version twice, and a slot held longer than ``round_deadline_s`` goes to another client. When
nobody trains and no client may be asked (every client was given the newest version and dropped out,
timed out or was refused), the buffer can never fill: it closes with the updates it holds, ``K`` fewer
than ``buffer_size`` (logged as ``version.short``; a departure from the paper, whose buffer always holds
``K`` updates), or with none (``version.empty``: the previous model again, as a new version that every
client is offered); ``max_round_retries + 1`` empty versions in a row abort the run, as a sync round
with no upload does.

Its settings are run-wide fields (``concurrency``, ``buffer_size``, ``staleness``, ``staleness_a``,
``staleness_b``, ``max_staleness``, ``server_lr``, ``round_deadline_s``, ``max_round_retries``),
checked by :class:`BufferedConfig`, and its own ``aggregation_params.weighting``; the slots,
versions and staleness weights here serve FedAsync too (``fedasync.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import structlog
import torch
from wafl.common.config import ConfigError, RunConfig, int_at_least, one_of, positive
from wafl.common.errors import Code, Refused, RunAborted
from wafl.server.staleness import STALENESS, StalenessFunction
from wafl.server.strategies.base import (
    Collection,
    Deliveries,
    Drain,
    RuleConfig,
    State,
    Strategy,
    Ticket,
    register,
)

log = structlog.get_logger("server")


@dataclass(frozen=True)
class AsyncConfig(RuleConfig):
    """The settings every asynchronous rule here shares: slots, the staleness weight and bound."""

    concurrency: int  # clients training at once
    staleness: StalenessFunction  # the weight of an update by its age in versions (wafl.server.staleness)
    max_staleness: int  # older updates are refused

    @classmethod
    def async_fields(cls, cfg: RunConfig) -> tuple[int, StalenessFunction, int]:
        """Checks the shared fields and the algorithm; returns ``(concurrency, staleness, max_staleness)``."""
        name = cfg.rule.aggregation
        if (
            cfg.federation.fraction != 1.0
            or cfg.federation.act_prob is not None
            or cfg.federation.min_clients is not None
        ):
            raise ConfigError(
                f"fraction, act_prob and min_clients apply to aggregation='sync'; aggregation={name!r} sets how "
                "many clients train at once with concurrency"
            )
        if cfg.evaluation.grad_dissimilarity_every:
            raise ConfigError(
                f"grad_dissimilarity_every={cfg.evaluation.grad_dissimilarity_every} needs aggregation='sync' "
                f"(the clients of a round at one global model), not {name!r}"
            )
        if cfg.rule.concurrency is not None:
            int_at_least("concurrency", cfg.rule.concurrency, 1)
            if cfg.rule.concurrency > cfg.federation.training_clients:
                raise ConfigError(
                    f"concurrency={cfg.rule.concurrency} is more than {cfg.federation.training_clients_text}"
                )
        try:
            staleness = STALENESS.lookup(cfg.rule.staleness)  # a registered staleness function (wafl.server.staleness)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        positive("staleness_a", cfg.rule.staleness_a)
        int_at_least("staleness_b", cfg.rule.staleness_b, 0)
        int_at_least("max_staleness", cfg.rule.max_staleness, 0)
        from wafl.common.algorithms import registry

        try:
            algo = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not algo.server.buffered_ok:
            raise ConfigError(
                f"algorithm={cfg.training.algorithm!r} does not combine with aggregation={name!r}: its server update "
                f"({type(algo.server).__name__}) keeps state built from one round's full models, while "
                "asynchronous aggregation publishes versions from stale, staleness-weighted updates"
            )
        weight = staleness(cfg.rule.staleness_a, cfg.rule.staleness_b)
        return cfg.rule.concurrency or cfg.federation.training_clients, weight, cfg.rule.max_staleness


WEIGHTINGS = ("uniform", "samples")


@dataclass(frozen=True)
class BufferedConfig(AsyncConfig):
    buffer_size: int  # accepted updates per new version
    server_lr: float  # step size of the averaged update
    weighting: str = "uniform"  # "uniform": sum_i s_i delta_i / K (the paper); "samples": by sample counts

    PARAMS: ClassVar[dict[str, Any]] = {"weighting": "uniform"}

    @classmethod
    def of(cls, cfg: RunConfig) -> BufferedConfig:
        weighting = cls.own_params(cfg)["weighting"]
        one_of("aggregation_params.weighting", weighting, WEIGHTINGS)
        concurrency, staleness, max_staleness = cls.async_fields(cfg)
        if cfg.rule.buffer_size is not None:
            int_at_least("buffer_size", cfg.rule.buffer_size, 1)
            if cfg.rule.buffer_size > concurrency:
                raise ConfigError(
                    f"buffer_size={cfg.rule.buffer_size} is more than the {concurrency} clients that train at once "
                    "(concurrency): no version could ever be published"
                )
        positive("server_lr", cfg.rule.server_lr)
        buffer_size = cfg.rule.buffer_size or max(1, concurrency // 2)
        return cls(concurrency, staleness, max_staleness, buffer_size, cfg.rule.server_lr, weighting)

    def uploads_per_aggregation(self, cfg: RunConfig) -> int:
        return self.buffer_size


@register("buffered")
class BufferedStrategy(Strategy):
    Config: ClassVar[type[BufferedConfig]] = BufferedConfig
    drain = Drain.WAIT
    uploads_are_deltas = True
    lock_step = False
    latest_pm = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = self.Config.of(self.cfg)
        self.concurrency = self.config.concurrency
        self.buffer_size = self.config.buffer_size
        self.weight_of = self.config.staleness
        self.closing: list[Collection] = []
        self.assigned: dict[str, tuple[int, float]] = {}  # client -> (version it trains on, when asked)
        self.trained: dict[str, int] = {}  # client -> the version it was last asked to train on
        self.draws = 0
        self.short = False  # the current buffer closes with fewer than buffer_size updates (see _starved)
        self.empty = 0  # versions in a row that were made with no update

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
            pick = idle.pop(int(np.random.default_rng([self.cfg.federation.seed, 7, self.draws]).integers(len(idle))))
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

    def fold_weight(self, num_samples: int, metrics: Mapping[str, float], staleness: int) -> float:
        """``s(age)`` (``weighting = "uniform"``) or ``s(age) n_i`` (``"samples"``)."""
        if self.config.weighting == "uniform":
            return self.staleness_weight(staleness)
        return super().fold_weight(num_samples, metrics, staleness)

    def _open_collections(self) -> tuple[Collection, ...]:
        return tuple(self.closing)

    def _admit(self, client_id: str, version: int, now: float) -> tuple[Collection, int]:
        if self.current is None or self.done:
            raise Refused("no version is being collected", Code.FAILED_PRECONDITION)
        given = self.assigned.get(client_id)
        if given is None or given[0] != version:
            raise Refused(
                f"client {client_id!r} was not asked to train on version {version}"
                + ("" if given is None else f" (it trains on version {given[0]})"),
                Code.FAILED_PRECONDITION,
            )
        # its age against the version its collection is applied to: after a close and before the
        # next model is built (drain, aggregation) that is the version being built, self.version + 1
        staleness = self.current.version - version
        if staleness > self.config.max_staleness:
            self.assigned.pop(client_id, None)
            raise Refused(
                f"an update from version {version} is {staleness} versions old; "
                f"max_staleness={self.config.max_staleness}",
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
        return self.short or len(self.collecting().metrics) >= self.buffer_size

    def next_deadline(self) -> float | None:
        if not self.assigned and not self.done and self.current is not None:
            return self.current.opened_at  # nobody trains: a tick now hands out the slots or closes the buffer
        first = min((t for _, t in self.assigned.values()), default=None)
        return None if first is None else first + self.cfg.federation.round_deadline_s

    def _starved(self) -> None:
        """Nobody trains and no client may be asked (each was given this version already: it dropped
        out, its slot expired or its update was refused): the buffer can never fill, so it closes with
        the updates it holds (none: the version is the previous model again, which gives every client a
        new version to train on). ``max_round_retries + 1`` versions in a row with no update abort the
        run, as a sync round with no upload does."""
        c = self.current
        if c is None or self.done or self.short or c.version != self.version or len(c.metrics) >= self.buffer_size:
            return
        got = len(c.metrics)
        if not got and self.empty >= self.cfg.federation.max_round_retries:
            raise RunAborted(
                f"aggregation={self.name!r}: no client uploaded for {self.empty + 1} versions in a row "
                f"(versions {self.version - self.empty}..{self.version}; "
                f"round_deadline_s={self.cfg.federation.round_deadline_s})"
            )
        self.short = True
        log.warning(
            "version.short" if got else "version.empty",
            round=c.version,
            uploads=got,
            buffer_size=self.buffer_size,
            reason="every client was given this version and none trains on it now (dropped out, expired or refused)",
        )

    def tick(self, now: float) -> Deliveries:
        expired = [c for c, (_, t) in self.assigned.items() if now - t >= self.cfg.federation.round_deadline_s]
        in_flight = {cid for c in (self.current, *self.closing) if c is not None for cid in c.in_flight}
        for cid in expired:
            if cid in in_flight:
                self.assigned[cid] = (self.assigned[cid][0], now)  # streaming: it gets another deadline
            else:
                del self.assigned[cid]  # its slot goes to someone else; a late upload is refused
        out = self._assign(now) if expired or not self.assigned else {}
        if not self.assigned:
            self._starved()
        return out

    def close(self, now: float) -> Collection:
        closing = self.collecting()
        closing.closed = True
        self.short = False
        self.empty = 0 if closing.metrics else self.empty + 1
        if closing.in_flight:
            self.closing.append(closing)
        self.current = self._collection(self.version + 1, now)
        return closing

    def combine(self, prev: State, collection: Collection) -> dict[str, torch.Tensor]:
        acc = collection.accumulator
        if acc.rule.keeps_uploads:  # a robust center of the deltas, unweighted
            mean, scale = acc.center(), self.config.server_lr
        else:
            mean = acc.mean()  # sum_i w_i delta_i / sum_i w_i, w_i = s(age_i) (uniform) or s(age_i) n_i
            per = acc.count if self.config.weighting == "uniform" else collection.samples  # K or sum_i n_i
            scale = self.config.server_lr * acc.total_weight / per
        out: dict[str, torch.Tensor] = {}
        for k, x in prev.items():
            step = mean[k].to(torch.float64) * scale
            out[k] = x + (step if x.is_floating_point() else torch.round(step)).to(x.dtype)
        return out

    def row(self, c: Collection) -> dict[str, Any]:
        s = c.staleness
        return {
            **super().row(c),
            "version": c.version + 1,
            "staleness_mean": sum(s) / len(s) if s else None,
            "staleness_max": max(s) if s else None,
        }

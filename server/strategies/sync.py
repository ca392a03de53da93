"""Lock-step rounds (FedAvg's schedule, McMahan et al., AISTATS 2017).

Round ``r`` selects clients (a fraction or an activation probability); version ``r`` goes to
the clients that do something with it: the selected ones, which train on it, every client when
the algorithm trains the personal part of unselected clients (``pm_when_unselected``), and, for
an algorithm with a personal phase, the clients selected in round ``r - 1``, whose PM phase ends
at this broadcast and is evaluated after it (``broadcast_all`` sends it to every client). The
round closes when every selected client uploaded or its deadline passed with ``min_clients``
uploads (a deadline with fewer is extended ``max_round_retries`` times); uploads still streaming
then are rolled back. Uploads are whole models; the algorithm's server update turns their
weighted mean into version ``r + 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from wafl.common.config import RunConfig
from wafl.common.errors import Code, Refused, RunAborted
from wafl.server.selection import select_clients
from wafl.server.strategies.base import (
    Collection,
    Deliveries,
    Drain,
    RuleConfig,
    State,
    Strategy,
    register,
)


@dataclass(frozen=True)
class SyncConfig(RuleConfig):
    """Sync's settings are run-wide fields (``fraction``, ``act_prob``, ``min_clients``, ``round_deadline_s``,
    ``max_round_retries``, ``broadcast_all``), checked with the run's own; no ``aggregation_params``."""

    def uploads_per_aggregation(self, cfg: RunConfig) -> int:
        """A round's selected clients (no more than ``min_clients``, with which a round may close)."""
        n = cfg.federation.training_clients
        share = cfg.federation.act_prob if cfg.federation.act_prob is not None else cfg.federation.fraction
        k = max(1, math.floor(share * n + (0.0 if cfg.federation.act_prob is not None else 0.5)))
        return min(k, cfg.federation.min_clients) if cfg.federation.min_clients is not None else k


@register("sync")
class SyncStrategy(Strategy):
    Config = SyncConfig
    drain = Drain.CANCEL
    lock_step = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.selected: set[str] = set()
        self.deadline = math.inf
        self.extensions = 0
        self.short = False  # the deadline passed with enough uploads

    def _open_round(self, now: float) -> Deliveries:
        v = self.version  # round v trains on version v
        ids = [c.client_id for c in sorted(self.clients.values(), key=lambda c: c.index)]
        self.selected = select_clients(
            self.cfg.federation.seed, v, ids, self.cfg.federation.fraction, self.cfg.federation.act_prob
        )
        self.current = self._collection(v, now)
        self.deadline = now + self.cfg.federation.round_deadline_s
        self.extensions = 0
        self.short = False
        return {c: c in self.selected for c in self._recipients(v, ids)}

    def _recipients(self, v: int, ids: list[str]) -> list[str]:
        """Who is sent version ``v`` (module docstring): an unselected client that neither trains its
        personal part on it nor ends a PM phase with it would only discard it."""
        a = self.algorithm
        if self.cfg.federation.broadcast_all or (a.personalized and a.pm_when_unselected):
            return ids
        keep = self.selected
        if a.personalized and v > 1:  # a pure function of the seed: the same after --resume
            keep = keep | select_clients(
                self.cfg.federation.seed, v - 1, ids, self.cfg.federation.fraction, self.cfg.federation.act_prob
            )
        return [c for c in ids if c in keep]

    def start(self, now: float) -> Deliveries:
        return self._open_round(now)

    def published(self, now: float) -> Deliveries:
        return {} if self.done else self._open_round(now)

    def _admit(self, client_id: str, version: int, now: float) -> tuple[Collection, int]:
        c = self.current
        if c is None or self.done:
            raise Refused("no round is open", Code.FAILED_PRECONDITION)
        if version < c.version or (version == c.version and c.closed):
            raise Refused(f"round {version} is closed; the current round is {c.version}", Code.FAILED_PRECONDITION)
        if version > c.version:
            raise Refused(f"round {version} has not opened; the current round is {c.version}", Code.FAILED_PRECONDITION)
        if client_id not in self.selected:
            raise Refused(f"client {client_id!r} is not selected for round {version}", Code.FAILED_PRECONDITION)
        return c, 0

    def ready(self) -> bool:
        # only selected clients commit into the round (``_admit``): counting them is enough
        return self.short or len(self.collecting().metrics) >= len(self.selected)

    def next_deadline(self) -> float | None:
        return self.deadline

    def tick(self, now: float) -> Deliveries:
        c = self.current
        if c is None or now < self.deadline or self.ready():
            return {}
        got = len(c.metrics)
        min_clients = min(self.cfg.federation.min_clients or 1, len(self.selected))
        if got >= min_clients or (got and self.extensions >= self.cfg.federation.max_round_retries):
            self.short = True
            return {}
        if self.extensions >= self.cfg.federation.max_round_retries:
            raise RunAborted(
                f"round {c.version}: no client uploaded within {self.extensions + 1} deadlines of "
                f"{self.cfg.federation.round_deadline_s}s"
            )
        self.extensions += 1
        self.deadline = now + self.cfg.federation.round_deadline_s
        return {}

    def close(self, now: float) -> Collection:
        c = self.collecting()
        c.closed = True
        return c

    def combine(self, prev: State, collection: Collection) -> dict[str, torch.Tensor]:
        acc = collection.accumulator
        server = self.algorithm.server
        server.collected([(collection.samples_of[cid], m) for cid, m in collection.metrics.items()])
        return server.finalize(prev, acc.center(server.robust_scaled), acc.count)

    def row(self, c: Collection) -> dict[str, Any]:
        return {**super().row(c), "selected": len(self.selected)}

    def expected_reports(self, c: Collection) -> set[str]:
        """The clients that trained their PM in this round: those that uploaded and, for an algorithm
        whose unselected clients train their personal part too, every client not selected; none in a
        round whose models are not evaluated (``eval_every``), or where the local model is the personal one."""
        if (
            self.algorithm.personalized
            and not self.algorithm.local_model_is_personal
            and self.evaluates_locally(c.version)
        ):
            unselected = set(self.clients) - self.selected if self.algorithm.pm_when_unselected else set()
            return set(c.metrics) | unselected
        return set()

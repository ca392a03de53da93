"""FedAsync (Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", arXiv:1903.03934, 2019;
also FLSim's asynchronous aggregation with its staleness weights): each update is mixed into the
model as it arrives.

An update trained from version ``tau`` that arrives when the newest version is ``t`` becomes
version ``t + 1``: ``x <- (1 - a) x + a x_new`` with ``a = alpha * s(t - tau)``; ``s`` is the
run's ``staleness`` rule (FedAsync's ``constant``, ``poly`` ``(t - tau + 1)^-a`` and ``hinge``, or
FedBuff's ``sqrt``). Uploads are whole models (every broadcast header says so); sample counts
play no part. Slots, staleness bound and deadlines are buffered aggregation's (``buffered.py``)
with a buffer of one. Updates that were already streaming when the previous one arrived finish
into the same version: ``x <- P x + (1 - P) sum_i a_i x_i / sum_i a_i`` with ``P = prod_i (1 - a_i)``,
which leaves on ``x`` the weight that mixing them one after another would (one update: the
formula above). Its one setting of its own is ``aggregation_params.alpha`` in (0, 1]
(default 0.6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from wafl.common.config import ConfigError, RunConfig, in_range
from wafl.server.strategies.base import Collection, State, register
from wafl.server.strategies.buffered import BufferedConfig, BufferedStrategy


@dataclass(frozen=True)
class FedAsyncConfig(BufferedConfig):
    alpha: float = 0.6  # the mixing weight of a fresh update

    PARAMS: ClassVar[dict[str, float]] = {"alpha": 0.6}

    @classmethod
    def of(cls, cfg: RunConfig) -> FedAsyncConfig:
        alpha = cls.own_params(cfg)["alpha"]
        in_range("aggregation_params.alpha", alpha, 0.0, 1.0, low_open=True)
        concurrency, staleness, max_staleness = cls.async_fields(cfg)
        if cfg.buffer_size is not None:
            raise ConfigError(
                f"buffer_size={cfg.buffer_size} applies to aggregation='buffered'; fedasync mixes each update into "
                "the model as it arrives"
            )
        if cfg.server_lr != 1.0:
            raise ConfigError(
                f"server_lr={cfg.server_lr} applies to aggregation='buffered'; fedasync's mixing weight is "
                "aggregation_params.alpha"
            )
        return cls(concurrency, staleness, max_staleness, 1, 1.0, float(alpha))

    def uploads_per_aggregation(self, cfg: RunConfig) -> int:
        return 1


@register("fedasync")
class FedAsyncStrategy(BufferedStrategy):
    Config: ClassVar[type[FedAsyncConfig]] = FedAsyncConfig
    uploads_are_deltas = False
    config: FedAsyncConfig

    def mixing(self, staleness: int) -> float:
        """``a = alpha * s(staleness)``: the weight of an update ``staleness`` versions old."""
        return self.config.alpha * self.weight_of(staleness)

    def fold_weight(self, num_samples: int, metrics: Mapping[str, float], staleness: int) -> float:
        return self.mixing(staleness)

    def combine(self, prev: State, collection: Collection) -> dict[str, torch.Tensor]:
        acc = collection.accumulator
        keep = math.prod(1.0 - self.mixing(s) for s in collection.staleness)  # the weight left on x
        new = acc.center() if acc.rule.keeps_uploads else acc.mean()  # a robust center ignores the a_i
        out: dict[str, torch.Tensor] = {}
        for k, x in prev.items():
            step = (new[k].to(torch.float64) - x.to(torch.float64)) * (1.0 - keep)
            out[k] = x + (step if x.is_floating_point() else torch.round(step)).to(x.dtype)
        return out

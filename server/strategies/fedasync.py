"""FedAsync (Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", arXiv:1903.03934, 2019;
also FLSim's asynchronous aggregation with its staleness weights): each update is mixed into the
model as it arrives.

An update trained from version ``tau`` whose collection is applied to version ``v`` (the newest
one, or the one being built when the update arrives after a close and before that version is
published) becomes version ``v + 1``: ``x <- (1 - a) x + a x_new`` with ``a = alpha * s(k)``; ``s``
is the run's ``staleness`` function (:mod:`wafl.server.staleness`: FedAsync's ``constant`` 1, ``poly``
``(k + 1)^-a`` and ``hinge`` 1 up to ``b``, then ``1/(a(k - b) + 1)``; or FedBuff's ``sqrt``
``1/sqrt(1 + k)``), and ``k = age + fresh_staleness`` with ``age = v - tau`` (0 for an update trained on ``x_v``):

* ``aggregation_params.fresh_staleness = 1`` (the default) is Xie et al.'s index: their updater's
  epoch ``t`` builds ``x_t`` from ``x_{t-1}`` and weighs the update with ``s(t - tau)``; here
  ``t = v + 1``, so ``k = t - tau = age + 1``: a fresh update counts 1 (``poly``:
  ``a = alpha * 2^-a``), one trained on ``x_tau`` counts ``(t - tau + 1)^-a``;
* ``fresh_staleness = 0`` is FLSim's convention (its staleness is the versions published since
  the update's own, so a fresh update counts 0 and mixes with ``a = alpha``): a departure from the
  paper's index, wafl's rule before this setting existed.

The results' ``staleness_mean``, ``staleness_max`` and the bound ``max_staleness`` count the age
``t - tau`` whichever index ``s`` sees. Uploads are whole models (every broadcast header says so);
sample counts play no part. Slots, staleness bound and deadlines are buffered aggregation's
(``buffered.py``) with a buffer of one. Updates that were already streaming when the previous one
arrived finish into the same version: ``x <- P x + (1 - P) sum_i a_i x_i / sum_i a_i`` with
``P = prod_i (1 - a_i)``, which leaves on ``x`` the weight that mixing them one after another would
(one update: the formula above). Its settings of its own are ``aggregation_params.alpha`` in
(0, 1] (default 0.6) and ``aggregation_params.fresh_staleness`` (0 or 1, default 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from wafl.common.config import ConfigError, RunConfig, in_range
from wafl.server.strategies.base import Collection, State, register
from wafl.server.strategies.buffered import BufferedConfig, BufferedStrategy


@dataclass(frozen=True)
class FedAsyncConfig(BufferedConfig):
    alpha: float = 0.6  # the mixing weight, times s(k)
    fresh_staleness: int = 1  # the index k of an update trained on the newest version (Xie et al.: 1; FLSim: 0)

    PARAMS: ClassVar[dict[str, Any]] = {"alpha": 0.6, "fresh_staleness": 1}

    @classmethod
    def of(cls, cfg: RunConfig) -> FedAsyncConfig:
        params = cls.own_params(cfg)
        alpha, fresh = params["alpha"], params["fresh_staleness"]
        in_range("aggregation_params.alpha", alpha, 0.0, 1.0, low_open=True)
        if isinstance(fresh, bool) or fresh not in (0, 1):
            raise ConfigError(
                f"aggregation_params.fresh_staleness={fresh!r} must be 0 (FLSim: a fresh update counts 0) or 1 "
                "(Xie et al.: t - tau, a fresh update counts 1)"
            )
        concurrency, staleness, max_staleness = cls.async_fields(cfg)
        if cfg.rule.buffer_size is not None:
            raise ConfigError(
                f"buffer_size={cfg.rule.buffer_size} applies to aggregation='buffered'; fedasync mixes each update "
                "into the model as it arrives"
            )
        if cfg.rule.server_lr != 1.0:
            raise ConfigError(
                f"server_lr={cfg.rule.server_lr} applies to aggregation='buffered'; fedasync's mixing weight is "
                "aggregation_params.alpha"
            )
        return cls(
            concurrency,
            staleness,
            max_staleness,
            buffer_size=1,
            server_lr=1.0,
            weighting="uniform",  # unused: fold_weight is the mixing weight
            alpha=float(alpha),
            fresh_staleness=int(fresh),
        )

    def uploads_per_aggregation(self, cfg: RunConfig) -> int:
        return 1


@register("fedasync")
class FedAsyncStrategy(BufferedStrategy):
    Config: ClassVar[type[FedAsyncConfig]] = FedAsyncConfig
    uploads_are_deltas = False
    config: FedAsyncConfig

    def mixing(self, staleness: int) -> float:
        """``a = alpha * s(fresh_staleness + staleness)``: the weight of an update ``staleness`` versions old."""
        return self.config.alpha * self.weight_of(self.config.fresh_staleness + staleness)

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

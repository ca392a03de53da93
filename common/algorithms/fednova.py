"""FedNova (Wang, Liu, Liang, Joshi and Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020): normalized averaging.

Clients train as FedAvg's do, for as many local steps ``tau_i`` as their data gives; a client
with more steps would pull the average toward its own objective. The server divides each
client's update by its step count and rescales the average by the effective number of steps:

    d_i = (x - x_i) / a_i,    x <- x - tau_eff * sum_i p_i d_i,    tau_eff = sum_i p_i a_i,

``p_i = n_i / sum_k n_k`` over the round's clients. For plain SGD without momentum ``a_i =
tau_i`` (the paper's Eq. 6 with ``a_i = [1, ..., 1]``); with heavy-ball momentum ``rho`` (the
run's ``momentum``, a fresh optimizer per round) a gradient of step ``k`` of ``tau_i`` counts
``(1 - rho^(tau_i - k + 1)) / (1 - rho)`` times, so ``a_i = ||a_i||_1 = sum_{m=1}^{tau_i} (1 -
rho^m) / (1 - rho)`` (the paper's momentum case). ``tau_i`` is what the upload declares
(``train_steps``): :meth:`NovaUpdate.weight` weights it ``n_i / a_i``, so the streaming mean is
``sum_i (p_i / a_i) x_i / W`` with ``W = sum_i p_i / a_i``, and ``x <- x - tau_eff W (x - mean)``
is the formula above (trained tensors; normalization statistics take the mean). Adam has no
such normalization and is refused, as is asynchronous aggregation (its steps are a round's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from wafl.common import metrics as M
from wafl.common.algorithms.base import Algorithm, ServerUpdate
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.server_updates import is_weight
from wafl.common.errors import Refused


def step_norm(steps: int, momentum: float) -> float:
    """``||a||_1`` of ``steps`` SGD steps with heavy-ball ``momentum`` (``steps`` when it is 0)."""
    if momentum == 0.0:
        return float(steps)
    r = momentum
    return (steps - r * (1.0 - r**steps) / (1.0 - r)) / (1.0 - r)


class NovaUpdate(ServerUpdate):
    """Weights ``n_i / a_i``; the round's ``tau_eff * W`` from :meth:`collected`; see the module docstring."""

    buffered_ok = False

    def __init__(self, momentum: float) -> None:
        self.momentum = momentum
        self.scale: float | None = None  # tau_eff * W of the round being finalized

    def _norm(self, metrics: Mapping[str, float] | None) -> float:
        steps = (metrics or {}).get(M.TRAIN_STEPS, 0.0)
        if not steps >= 1:
            raise Refused(f"fednova normalizes by each upload's {M.TRAIN_STEPS}, which must be >= 1 (got {steps:g})")
        return step_norm(int(steps), self.momentum)

    def weight(self, num_samples: int, metrics: Mapping[str, float] | None = None) -> float:
        return num_samples / self._norm(metrics)

    def collected(self, uploads: list[tuple[int, Mapping[str, float]]]) -> None:
        total = float(sum(n for n, _ in uploads))
        norms = [(n / total, self._norm(m)) for n, m in uploads]
        tau_eff = sum(p * a for p, a in norms)
        self.scale = tau_eff * sum(p / a for p, a in norms)

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        scale, self.scale = self.scale, None
        if scale is None:
            raise RuntimeError("NovaUpdate.finalize needs the round's uploads (collected) first")
        out = dict(mean)
        for k, x in prev.items():
            if is_weight(k, x):
                x64 = x.to(torch.float64)
                out[k] = (x64 - scale * (x64 - mean[k].to(torch.float64))).to(x.dtype)
        return out


def build(p: dict[str, Any], run: Mapping[str, Any]) -> Algorithm:
    if run.get("optimizer", "sgd") != "sgd":
        raise ValueError(f"algorithm='fednova' normalizes SGD steps: optimizer={run['optimizer']!r} must be 'sgd'")
    return Algorithm("fednova", p, server=NovaUpdate(float(run.get("momentum", 0.0))))


register("fednova", {}, build)

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
is the formula above, on the trained tensors. Adam has no such normalization and is refused, as is
asynchronous aggregation (its steps are a round's).

Server momentum (the paper also runs FedNova with it, the authors' ``gmf``; ``server_momentum =
beta``, 0 by default, which is the update above): with ``Delta = tau_eff sum_i p_i d_i``,

    v <- beta v + Delta,    x <- x - v                           (v zero at first, checkpointed)

the authors' code keeps ``v / lr`` and steps by ``lr``, the same while the learning rate is constant
(it is in wafl unless ``lr_decay`` is below 1: then ``v`` here keeps the updates of earlier rounds at their own
rates, where the authors' rescales them to the current one).

Departure, normalization statistics: BatchNorm's running mean and variance (and its batch count)
take the streaming mean with the same weights ``n_i / a_i``, not the sample-weighted mean
``sum_i p_i x_i``: the accumulator folds each upload with one weight, and a statistic is not an
update to normalize, so neither rule is the paper's (its algorithm has no statistics; the authors'
optimizer averages the parameters only and leaves each worker its own). A client that ran fewer
steps weighs more in them; with equal step counts they are FedAvg's sample-weighted mean.

Departure, robust centers (``aggregator = median`` or ``trimmed_mean``; the paper has none): the
robust centers ignore the sample counts, and a weighted ``tau_eff`` would let one upload's declared
``train_steps`` (and ``n_i``) scale the whole step without bound. So the center is taken of the
normalized updates themselves and of the step norms, with the same rule and no weights:

    x <- x - center_i(a_i) * center_i(d_i)                       (center: coordinate-wise median or
                                                                  trimmed mean, as the aggregator's)

(:meth:`NovaUpdate.weight` is then ``1 / a_i`` and the aggregator centers ``x + (x_i - x) / a_i``,
``ServerUpdate.robust_scaled``; a clipped update is normalized after clipping). With equal step
counts this is the aggregator's robust center of the models, as for FedAvg; normalization
statistics take the robust center of the clients' statistics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from wafl.common import metrics as M
from wafl.common.algorithms.base import Algorithm, ServerUpdate
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.server_updates import is_weight
from wafl.common.errors import Refused

ROBUST = ("median", "trimmed_mean")  # the aggregator's robust centers (wafl.server.aggregation.robust)


def step_norm(steps: int, momentum: float) -> float:
    """``||a||_1`` of ``steps`` SGD steps with heavy-ball ``momentum`` (``steps`` when it is 0)."""
    if momentum == 0.0:
        return float(steps)
    r = momentum
    return (steps - r * (1.0 - r**steps) / (1.0 - r)) / (1.0 - r)


class NovaUpdate(ServerUpdate):
    """Weights ``n_i / a_i`` (``1 / a_i`` under a robust center); the round's rescaling from
    :meth:`collected`; optional server momentum. See the module docstring."""

    buffered_ok = False

    def __init__(self, momentum: float, server_momentum: float = 0.0, center: str = "mean", trim: float = 0.1) -> None:
        self.momentum = momentum
        self.server_momentum = server_momentum
        self.center, self.trim = center, trim
        self.robust_scaled = center in ROBUST
        self.scale: float | None = None  # tau_eff * W of the round being finalized (tau_eff under a robust center)
        self.velocity: dict[str, torch.Tensor] = {}

    def _norm(self, metrics: Mapping[str, float] | None) -> float:
        steps = (metrics or {}).get(M.TRAIN_STEPS, 0.0)
        if not steps >= 1:
            raise Refused(f"fednova normalizes by each upload's {M.TRAIN_STEPS}, which must be >= 1 (got {steps:g})")
        return step_norm(int(steps), self.momentum)

    def weight(self, num_samples: int, metrics: Mapping[str, float] | None = None) -> float:
        return (1.0 if self.robust_scaled else num_samples) / self._norm(metrics)

    def collected(self, uploads: list[tuple[int, Mapping[str, float]]]) -> None:
        if self.robust_scaled:  # center_i(a_i), unweighted, as the aggregator centers the d_i
            self.scale = robust_center([self._norm(m) for _, m in uploads], self.center, self.trim)
            return
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
                step = scale * (x64 - mean[k].to(torch.float64))  # Delta = tau_eff sum_i p_i d_i
                if self.server_momentum:
                    v = self.velocity.get(k)
                    step = step if v is None else self.server_momentum * v.to(torch.float64) + step
                    self.velocity[k] = step.to(x.dtype)
                out[k] = (x64 - step).to(x.dtype)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": self.velocity} if self.server_momentum else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.velocity = dict(state.get("velocity", {}))


def robust_center(values: list[float], center: str, trim: float) -> float:
    """The median of ``values``, or their mean after dropping the ``floor(trim * k)`` smallest and largest
    (the aggregator's coordinate-wise rules on one coordinate)."""
    v = sorted(values)
    k = len(v)
    if center == "median":
        return 0.5 * (v[(k - 1) // 2] + v[k // 2])
    cut = math.floor(trim * k)
    kept = v[cut : k - cut]
    return sum(kept) / len(kept)


@dataclass(frozen=True)
class FedNovaParams:
    server_momentum: float = param(0.0, "[0, 1)")


def build(p: FedNovaParams, run: Mapping[str, Any]) -> Algorithm:
    if run.get("optimizer", "sgd") != "sgd":
        raise ValueError(f"algorithm='fednova' normalizes SGD steps: optimizer={run['optimizer']!r} must be 'sgd'")
    center = str(run.get("aggregator", "mean"))
    if center != "mean" and center not in ROBUST:
        # its rescaling applies the center to the step norms itself (robust_center), which knows these two only
        raise ValueError(
            f"algorithm='fednova' with aggregator={center!r}: its rescaling knows the centers {['mean', *ROBUST]}"
        )
    server = NovaUpdate(
        float(run.get("momentum", 0.0)), p.server_momentum, center, float(run.get("trim_fraction", 0.1))
    )
    return Algorithm("fednova", server=server)


register("fednova", FedNovaParams, build)

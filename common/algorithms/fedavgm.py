"""FedAvgM (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", arXiv:1909.06335, 2019): FedAvg locally, server momentum on the
pseudo-gradient."""

from __future__ import annotations

from dataclasses import dataclass

from wafl.common.algorithms.base import Algorithm
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.server_updates import MomentumUpdate


@dataclass(frozen=True)
class FedAvgMParams:
    server_momentum: float = param(0.9, "[0, 1)")
    server_lr: float = param(1.0, "> 0")


register(
    "fedavgm",
    FedAvgMParams,
    lambda p, run: Algorithm("fedavgm", server=MomentumUpdate(p.server_momentum, p.server_lr)),
)

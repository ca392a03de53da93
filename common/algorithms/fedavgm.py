"""FedAvgM (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", arXiv:1909.06335, 2019): FedAvg locally, server momentum on the
pseudo-gradient."""

from __future__ import annotations

from wafl.common.algorithms.base import Algorithm
from wafl.common.algorithms.registry import Param, register
from wafl.common.algorithms.server_updates import MomentumUpdate

register(
    "fedavgm",
    {"server_momentum": Param(0.9, "[0, 1)"), "server_lr": Param(1.0, "> 0")},
    lambda p, run: Algorithm("fedavgm", p, server=MomentumUpdate(p["server_momentum"], p["server_lr"])),
)

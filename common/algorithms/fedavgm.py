"""FedAvgM: FedAvg locally, server momentum on the pseudo-gradient."""

from __future__ import annotations

from wafl.common.algorithms.base import Algorithm
from wafl.common.algorithms.registry import Param, register
from wafl.common.algorithms.server_updates import MomentumUpdate

register(
    "fedavgm",
    {"server_momentum": Param(0.9, "[0, 1)"), "server_lr": Param(1.0, "> 0")},
    lambda p, run: Algorithm("fedavgm", p, server=MomentumUpdate(p["server_momentum"], p["server_lr"])),
)

"""``staleness = "sqrt"``: FedBuff's weight (Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022): ``s(k) = 1/sqrt(1+k)``. Reads neither ``a`` nor ``b``."""

from __future__ import annotations

import math

from wafl.server.staleness.base import STALENESS, StalenessFunction


@STALENESS.register("sqrt")
class Sqrt(StalenessFunction):
    def __call__(self, k: int) -> float:
        return 1.0 / math.sqrt(1.0 + k)

"""``staleness = "constant"``: FedAsync's constant weight (Xie, Koyejo and Gupta, "Asynchronous Federated
Optimization", 2019): ``s(k) = 1``, every update counts fully whatever its age. Reads neither ``a`` nor
``b``."""

from __future__ import annotations

from wafl.server.staleness.base import STALENESS, StalenessFunction


@STALENESS.register("constant")
class Constant(StalenessFunction):
    def __call__(self, k: int) -> float:
        return 1.0

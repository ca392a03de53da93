"""``staleness = "poly"``: FedAsync's polynomial weight (Xie, Koyejo and Gupta, "Asynchronous Federated
Optimization", 2019): ``s(k) = (1+k)^-a``, ``a = staleness_a``."""

from __future__ import annotations

from wafl.server.staleness.base import STALENESS, StalenessFunction


@STALENESS.register("poly")
class Poly(StalenessFunction):
    def __call__(self, k: int) -> float:
        return (1.0 + k) ** -self.a

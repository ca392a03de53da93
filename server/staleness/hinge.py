"""``staleness = "hinge"``: FedAsync's hinge weight (Xie, Koyejo and Gupta, "Asynchronous Federated
Optimization", 2019): ``s(k) = 1`` for ``k <= b``, then ``1/(a(k-b)+1)``; ``a = staleness_a``,
``b = staleness_b``."""

from __future__ import annotations

from wafl.server.staleness.base import STALENESS, StalenessFunction


@STALENESS.register("hinge")
class Hinge(StalenessFunction):
    def __call__(self, k: int) -> float:
        return 1.0 if k <= self.b else 1.0 / (self.a * (k - self.b) + 1.0)

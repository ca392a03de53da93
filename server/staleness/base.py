"""What a staleness function is, and the registry of them by the run's ``staleness``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from wafl.common.registry import Registry


@dataclass(frozen=True)
class StalenessFunction(ABC):
    """The weight of an update ``k`` versions old, built from the run's settings: ``a`` is ``staleness_a``,
    ``b`` is ``staleness_b`` (each function reads those it uses). ``k`` is the age an asynchronous rule
    gives it (buffered: the versions published since the update's own; fedasync: that plus its
    ``fresh_staleness``)."""

    a: float  # the run's staleness_a
    b: int  # the run's staleness_b

    @abstractmethod
    def __call__(self, k: int) -> float:
        """The weight of an update ``k`` versions old."""


# by the configuration's ``staleness``; each file of this package registers its function (@STALENESS.register)
STALENESS: Registry[type[StalenessFunction]] = Registry("staleness", "wafl.server.staleness")


def staleness_function(name: str, a: float, b: int) -> StalenessFunction:
    """The staleness function ``name`` with the settings ``a`` (``staleness_a``) and ``b`` (``staleness_b``);
    ``ValueError`` naming the field and the registered names when ``name`` is none of them."""
    return STALENESS.lookup(name)(a, b)

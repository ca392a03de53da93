"""How uploads combine (:class:`Rule`), and the configuration's ``aggregator`` it is made from."""

from __future__ import annotations

from dataclasses import dataclass

from wafl.common.config import ConfigError, RunConfig
from wafl.server.aggregation.robust import MEAN, center_names


@dataclass(frozen=True)
class Rule:
    """How uploads combine: ``center`` (the weighted mean or a robust center), optional update-norm
    clipping: at the fixed ``clip_norm``, or else (``adaptive`` > 0) at the bound each collection's
    accumulator is given (:attr:`Accumulator.bound`, see :class:`NormBound`)."""

    center: str = MEAN  # the configuration's ``aggregator``: MEAN or a robust center's name
    trim: float = 0.1  # trimmed_mean: share of the values dropped at each end of every coordinate
    clip_norm: float | None = None  # L2 bound on each upload's update (floating-point tensors)
    adaptive: float = 0.0  # without clip_norm: the bound's multiple of the median of recent accepted norms

    @property
    def keeps_uploads(self) -> bool:
        return self.center != MEAN

    @property
    def measures(self) -> bool:
        """Whether each upload's update norm is measured (clipped, recorded, refused beyond float32)."""
        return self.clip_norm is not None or self.adaptive > 0


def check_aggregator(cfg: RunConfig) -> None:
    """The ``aggregator``: the weighted mean or a registered robust center (called by
    ``wafl.server.strategies.check_aggregation``). Whether it can do what it is for with the uploads one
    aggregation combines (:func:`~wafl.server.aggregation.robust.check_robust`) depends on the round policy,
    which checks it there."""
    if cfg.security.aggregator not in center_names():
        raise ConfigError(f"aggregator={cfg.security.aggregator!r} is not one of {center_names()}")

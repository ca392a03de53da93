"""Round policies, one file per rule: who trains on which model version, what becomes of each
update, when the next version is published, and how the gathered updates become it.

* ``base.py``: the :class:`~wafl.server.strategies.base.Strategy` interface the engine calls, the
  collections of updates, :func:`~wafl.server.strategies.base.register`;
* ``sync.py``: lock-step rounds (``aggregation = "sync"``, the default);
* ``buffered.py``: buffered asynchronous aggregation, FedBuff (``"buffered"``);
* ``fedasync.py``: each update mixed in as it arrives, FedAsync (``"fedasync"``).

A new rule is one new file (and its test): a :class:`~wafl.server.strategies.base.Strategy` subclass
decorated with ``@register("name")``, whose ``Config`` reads and checks its settings. The rules' registry,
:data:`~wafl.server.strategies.base.STRATEGIES` (a :class:`~wafl.common.registry.Registry`), imports every
module of this package the first time it is read, so no list of rules is kept anywhere.
:func:`check_aggregation` checks a run's rule and its aggregator; it is called explicitly where a
configuration enters (the command line's flags, a sweep's points, the server's start, an in-process run),
since ``RunConfig.validate`` knows no rule and no aggregator.
"""

from __future__ import annotations

from collections.abc import Callable

from wafl.common.algorithms.base import Algorithm
from wafl.common.config import ConfigError, RunConfig
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.aggregation.robust import check_robust
from wafl.server.aggregation.rule import check_aggregator
from wafl.server.strategies.base import STRATEGIES, Collection, Deliveries, Drain, Strategy

__all__ = [
    "STRATEGIES",
    "Collection",
    "Deliveries",
    "Drain",
    "Strategy",
    "check_aggregation",
    "make_strategy",
    "strategy_class",
]


def check_aggregation(cfg: RunConfig) -> RunConfig:
    """The aggregation of a validated configuration (``RunConfig.validate``): a known aggregator
    (:func:`~wafl.server.aggregation.rule.check_aggregator`), a known rule, its settings (its ``Config``),
    and an aggregator that can do what it is for with the uploads one aggregation of this rule combines;
    returns ``cfg``. Raises ``ConfigError`` naming the field."""
    check_aggregator(cfg)
    settings = strategy_class(cfg).check_config(cfg)
    why = check_robust(cfg.security.aggregator, cfg.security.trim_fraction, settings.uploads_per_aggregation(cfg))
    if why is not None:
        raise ConfigError(why)
    return cfg


def strategy_class(cfg: RunConfig) -> type[Strategy]:
    """The rule ``aggregation`` names; ``ConfigError`` naming every rule when it names none."""
    try:
        return STRATEGIES.lookup(cfg.rule.aggregation)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def make_strategy(
    cfg: RunConfig, algorithm: Algorithm, num_classes: int, new_accumulator: Callable[[], Accumulator]
) -> Strategy:
    return strategy_class(cfg)(cfg, algorithm, num_classes, new_accumulator)

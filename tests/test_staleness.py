"""The staleness functions (``server/staleness/``, one file each) against their docstring formulas, bit for
bit: the weights FedBuff's ``sqrt`` and FedAsync's ``constant``, ``poly`` and ``hinge`` gave before they were
files of their own (``staleness_function``'s table of lambdas in ``server/strategies/buffered.py``)."""

from __future__ import annotations

import math

import pytest
from wafl.common.config import ConfigError, load_config
from wafl.server.staleness import STALENESS, StalenessFunction, staleness_function
from wafl.server.strategies import check_aggregation
from wafl.server.strategies.buffered import BufferedConfig


def formulas(a: float, b: int) -> dict:
    return {
        "sqrt": lambda s: 1.0 / math.sqrt(1.0 + s),  # FedBuff
        "constant": lambda s: 1.0,  # FedAsync (Xie et al. 2019)
        "poly": lambda s: (1.0 + s) ** -a,
        "hinge": lambda s: 1.0 if s <= b else 1.0 / (a * (s - b) + 1.0),
    }


@pytest.mark.parametrize("a, b", [(0.5, 4), (1.0, 0), (0.3, 2), (2, 1)])
def test_each_function_is_its_formula_bit_for_bit(a: float, b: int) -> None:
    want = formulas(a, b)
    assert sorted(STALENESS) == sorted(want)
    for name, f in want.items():
        g = staleness_function(name, a, b)
        assert isinstance(g, StalenessFunction) and (g.a, g.b) == (a, b)
        assert [g(s) for s in range(40)] == [f(s) for s in range(40)], name  # == on floats: the same bits


def test_the_rule_builds_the_run_s_function_from_its_settings() -> None:
    cfg = load_config(None, {"num_clients": 4, "aggregation": "buffered", "staleness": "hinge", "staleness_a": 0.25})
    weight = BufferedConfig.of(cfg).staleness
    assert type(weight) is STALENESS["hinge"] and (weight.a, weight.b) == (0.25, 4)
    assert [weight(s) for s in (4, 5, 8)] == [1.0, 1.0 / 1.25, 0.5]


def test_an_unknown_function_is_refused_naming_the_field_and_every_function() -> None:
    with pytest.raises(ValueError, match=r"staleness='cubic' is not one of \['constant', 'hinge', 'poly', 'sqrt'\]"):
        staleness_function("cubic", 0.5, 4)
    cfg = load_config(None, {"num_clients": 4, "aggregation": "fedasync", "staleness": "cubic"})
    with pytest.raises(ConfigError, match=r"staleness='cubic' is not one of \['constant', 'hinge', 'poly', 'sqrt'\]"):
        check_aggregation(cfg)

"""The rules an algorithm's parameters are checked with (``wafl.common.algorithms.registry``)."""

from __future__ import annotations

import pytest
from wafl.common.algorithms.registry import COUNT, POSITIVE, Choice, Flag, Param, rule_of


@pytest.mark.parametrize(
    ("param", "value", "taken"),
    [
        (Param(1.0, "> 0"), "0.5", 0.5),
        (Param(1, "int >= 1"), 3.0, 3),
        (Param(False, "bool"), "True", True),
        (Param("model", "model|layer"), "layer", "layer"),
        (Param(0, COUNT), "2", 2),
    ],
)
def test_a_valid_value_is_taken_in_the_rules_type(param: Param, value: object, taken: object) -> None:
    got = param.check("p", value)
    assert got == taken and type(got) is type(taken)


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        (Param(1.0, "> 0"), 0, "params.p=0 must be > 0"),
        (Param(1.0, "> 0"), "x", "params.p='x' must be a number > 0"),
        (Param(1.0, "(0, 1]"), float("inf"), "params.p=inf must be (0, 1]"),
        (Param(1, "int >= 1"), 1.5, "params.p=1.5 must be int >= 1"),
        (Param(False, "bool"), "yes", "params.p='yes' must be true or false"),
        (Param("model", "model|layer"), "row", "params.p='row' must be one of ['model', 'layer']"),
    ],
)
def test_a_bad_value_is_refused_naming_the_parameter_and_the_rule(param: Param, value: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        param.check("p", value)
    assert str(e.value) == message


def test_a_rule_text_names_the_typed_rule() -> None:
    assert rule_of("> 0") is POSITIVE
    assert rule_of("bool") == Flag()
    assert rule_of("full|head") == Choice(("full", "head"))
    assert Param(1.0, "> 0").checker is Param(1.0, POSITIVE).checker is POSITIVE


def test_an_unknown_rule_text_is_refused_when_the_parameter_is_declared() -> None:
    with pytest.raises(ValueError, match=r"parameter rule '> 1' is not one of \["):
        Param(2.0, "> 1")

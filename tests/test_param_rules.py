"""An algorithm's parameters: the rules a value is checked with and the dataclass that declares them
(``wafl.common.algorithms.params``), and what ``registry.resolve`` hands the builders."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from wafl.common.algorithms import registry
from wafl.common.algorithms.base import Algorithm
from wafl.common.algorithms.params import (
    COUNT,
    POSITIVE,
    Choice,
    Flag,
    ParamRule,
    earlier_values,
    fields_of,
    instance,
    param,
    rule_of,
)


@pytest.mark.parametrize(
    ("rule", "value", "taken"),
    [
        ("> 0", "0.5", 0.5),
        ("int >= 1", 3.0, 3),
        ("bool", "True", True),
        ("model|layer", "layer", "layer"),
        (COUNT, "2", 2),
    ],
)
def test_a_valid_value_is_taken_in_the_rules_type(rule: ParamRule | str, value: object, taken: object) -> None:
    got = (rule_of(rule) if isinstance(rule, str) else rule).check("p", value)
    assert got == taken and type(got) is type(taken)


@pytest.mark.parametrize(
    ("rule", "value", "message"),
    [
        ("> 0", 0, "params.p=0 must be > 0"),
        ("> 0", "x", "params.p='x' must be a number > 0"),
        ("(0, 1]", float("inf"), "params.p=inf must be (0, 1]"),
        ("int >= 1", 1.5, "params.p=1.5 must be int >= 1"),
        ("bool", "yes", "params.p='yes' must be true or false"),
        ("model|layer", "row", "params.p='row' must be one of ['model', 'layer']"),
    ],
)
def test_a_bad_value_is_refused_naming_the_parameter_and_the_rule(rule: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        rule_of(rule).check("p", value)
    assert str(e.value) == message


def test_a_rule_text_names_the_typed_rule() -> None:
    assert rule_of("> 0") is POSITIVE
    assert rule_of("bool") == Flag()
    assert rule_of("full|head") == Choice(("full", "head"))

    @dataclass(frozen=True)
    class Both:
        a: float = param(1.0, "> 0")
        b: float = param(1.0, POSITIVE)

    assert [d.rule for d in fields_of(Both)] == [POSITIVE, POSITIVE]


def test_an_unknown_rule_text_is_refused_when_the_parameters_are_declared() -> None:
    with pytest.raises(ValueError, match=r"parameter rule '> 1' is not one of \["):

        @dataclass(frozen=True)
        class Bad:
            a: float = param(2.0, "> 1")


def test_a_keyword_parameter_keeps_its_public_name() -> None:
    @dataclass(frozen=True)
    class Keyword:
        lambda_: float = param(1.0, ">= 0", name="lambda")
        k: int = param(5, "int >= 1")

    assert [(d.name, d.attribute) for d in fields_of(Keyword)] == [("lambda", "lambda_"), ("k", "k")]
    p = instance(Keyword, {"lambda": 3.0, "k": 2})
    assert (p.lambda_, p.k) == (3.0, 2)


def test_a_parameter_added_later_names_the_value_earlier_runs_had() -> None:
    """``before``: the value a run made before the field existed behaved as, checked by the field's rule;
    ``registry.earlier`` gathers them over a composed algorithm's classes (FedSpeed's ``dual_mean``)."""

    @dataclass(frozen=True)
    class Later:
        a: float = param(1.0, "> 0")
        mode: str = param("new", "old|new", before="old")

    assert earlier_values(Later) == {"mode": "old"}
    assert registry.earlier("fedspeed+asd") == {"dual_mean": "participants"}
    assert registry.earlier("fedavg") == {} and registry.earlier("no-such-algorithm") == {}

    @dataclass(frozen=True)
    class BadBefore:
        mode: str = param("new", "old|new", before="older")

    with pytest.raises(ValueError, match=r"BadBefore\.mode: the before params\.mode='older' must be one of"):
        fields_of(BadBefore)


def test_a_class_that_does_not_declare_its_parameters_with_param_is_refused() -> None:
    @dataclass
    class Mutable:
        a: float = param(1.0, "> 0")

    @dataclass(frozen=True)
    class Plain:
        a: float = field(default=1.0)

    @dataclass(frozen=True)
    class BadDefault:
        a: float = param(0.0, "> 0")

    with pytest.raises(TypeError, match="frozen dataclass"):
        fields_of(Mutable)
    with pytest.raises(TypeError, match=r"Plain\.a is not declared with param"):
        fields_of(Plain)
    with pytest.raises(ValueError, match=r"BadDefault\.a: the default params\.a=0\.0 must be > 0"):
        fields_of(BadDefault)
    with pytest.raises(TypeError, match="frozen dataclass"):
        registry.register("not-registered", Mutable, lambda p, run: Algorithm("not-registered"))


def test_resolve_hands_each_builder_its_dataclass_and_keeps_the_public_names() -> None:
    algo = registry.resolve("pfedme+asd", {"lambda": "7.5", "k": 3.0, "asd_uniform": "true"})
    assert algo.params == {
        "lambda": 7.5,
        "personal_lr": 0.01,
        "k": 3,
        "beta": 1.0,
        "asd_lambda": 2.0,
        "asd_temperature": 2.0,
        "asd_uniform": True,
    }
    assert list(algo.params) == ["lambda", "personal_lr", "k", "beta", "asd_lambda", "asd_temperature", "asd_uniform"]
    step = algo.phases[0].step if algo.phases else None
    assert (getattr(step, "lam", None), getattr(step, "k", None)) == (7.5, 3)
    assert [(t.name, t.weight, t.uniform) for t in algo.gm_terms] == [("asd", 2.0, True)]

"""An algorithm's parameters: one frozen dataclass per algorithm (or regularizer), in its own file.

Each field is declared with :func:`param`, which carries its default and the rule a given value must meet
(a rule below, or its text: ``"> 0"``, ``"int >= 1"``, ``"bool"``, ``"model|layer"``, ...)::

    @dataclass(frozen=True)
    class FedProxParams:
        mu: float = param(0.01, "> 0")

A field whose public name is a Python keyword keeps that name through ``name``:
``lambda_: float = param(1.0, ">= 0", name="lambda")`` is ``params.lambda`` and ``-p lambda=...``.
A field added to a class after runs were made without it names, through ``before``, the value those runs
behaved as (``param("participants", "participants|all", before="participants")``): a finished run's
configuration that lacks the field then reads as that value (:func:`earlier_values`), so it still counts as the
same configuration where the new default keeps the old behaviour.
:func:`fields_of` reads a class's declared fields (refusing any other class) and :func:`instance` builds the
dataclass from values checked by public name (:func:`wafl.common.algorithms.registry.resolve`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
P = TypeVar("P")


@dataclass(frozen=True)
class Number:
    """A numeric parameter's rule: ``test`` on the finite value; ``text`` is the rule as messages print it."""

    text: str
    test: Callable[[float], bool]
    integer: bool = False  # the value is taken as an int

    def check(self, name: str, value: Any) -> float | int:
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"params.{name}={value!r} must be a number {self.text}") from None
        if not (math.isfinite(v) and self.test(v)):
            raise ValueError(f"params.{name}={value!r} must be {self.text}")
        return int(v) if self.integer else v


@dataclass(frozen=True)
class Flag:
    """A true-or-false parameter (``true``/``false``/``1``/``0`` as text too)."""

    text: str = "bool"

    def check(self, name: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ValueError(f"params.{name}={value!r} must be true or false")


@dataclass(frozen=True)
class Choice:
    """A parameter that is one of ``options``; its text is ``"a|b"``."""

    options: tuple[str, ...]

    @property
    def text(self) -> str:
        return "|".join(self.options)

    def check(self, name: str, value: Any) -> Any:
        if value not in self.options:
            raise ValueError(f"params.{name}={value!r} must be one of {list(self.options)}")
        return value


ParamRule = Number | Flag | Choice

POSITIVE = Number("> 0", lambda v: v > 0)
NON_NEGATIVE = Number(">= 0", lambda v: v >= 0)
UNIT = Number("(0, 1]", lambda v: 0 < v <= 1)
UNIT_FROM_ZERO = Number("[0, 1)", lambda v: 0 <= v < 1)
OPEN_UNIT = Number("(0, 1)", lambda v: 0 < v < 1)
COUNT = Number("int >= 0", lambda v: v >= 0 and v.is_integer(), integer=True)
POSITIVE_COUNT = Number("int >= 1", lambda v: v >= 1 and v.is_integer(), integer=True)
FLAG = Flag()

#: the named rules by their text, which :func:`param` takes instead of the rule
RULES: dict[str, ParamRule] = {
    r.text: r for r in (POSITIVE, NON_NEGATIVE, UNIT, UNIT_FROM_ZERO, OPEN_UNIT, COUNT, POSITIVE_COUNT, FLAG)
}

_RULE, _NAME, _BEFORE = "wafl.param.rule", "wafl.param.name", "wafl.param.before"  # param()'s metadata keys
_UNSET = object()


def rule_of(text: str) -> ParamRule:
    """The rule a text names: one of :data:`RULES`, or ``"a|b|..."`` for a :class:`Choice`; raises
    ``ValueError`` for any other text (when the parameters' class is defined, not when a user's value is checked)."""
    if "|" in text:
        return Choice(tuple(text.split("|")))
    if text not in RULES:
        raise ValueError(f"parameter rule {text!r} is not one of {sorted(RULES)} nor a choice 'a|b'")
    return RULES[text]


def param(default: T, rule: ParamRule | str, *, name: str | None = None, before: Any = _UNSET) -> T:
    """A dataclass field with ``default`` and the rule a given value must meet (a rule, or its text for
    :func:`rule_of`); ``name``: the public name where it is not the attribute's (a Python keyword); ``before``:
    for a field added after runs were made without it, the value those runs behaved as."""
    checker = rule_of(rule) if isinstance(rule, str) else rule
    meta: dict[str, Any] = {_RULE: checker, _NAME: name}
    if before is not _UNSET:
        meta[_BEFORE] = before
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Declared:
    """One field of a parameters class: its public ``name``, the dataclass ``attribute``, default and rule."""

    name: str
    attribute: str
    default: Any
    rule: ParamRule
    before: Any = _UNSET  # the value runs made before the field existed behaved as (param(before=...))

    def check(self, value: Any) -> Any:
        """The value as the algorithm takes it (a number, an int, a bool, a choice); raises ``ValueError``
        naming ``params.<name>`` and the rule."""
        return self.rule.check(self.name, value)


@dataclass(frozen=True)
class NoParams:
    """The parameters of an algorithm that takes none."""


def fields_of(cls: type[Any]) -> list[Declared]:
    """The declared fields of a parameters class in their order. Raises ``TypeError`` for a class that is not a
    frozen dataclass or a field not declared with :func:`param`, ``ValueError`` for a default its rule refuses."""
    frozen = dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    if not (isinstance(cls, type) and frozen):
        raise TypeError(f"{getattr(cls, '__name__', cls)!r}: an algorithm's parameters are a frozen dataclass")
    out: list[Declared] = []
    for f in dataclasses.fields(cls):
        if _RULE not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with param(default, rule)")
        d = Declared(f.metadata[_NAME] or f.name, f.name, f.default, f.metadata[_RULE], f.metadata.get(_BEFORE, _UNSET))
        for what, value in (("default", d.default), ("before", d.before)):
            try:
                if value is not _UNSET:
                    d.check(value)
            except ValueError as e:
                raise ValueError(f"{cls.__name__}.{f.name}: the {what} {e}") from None
        out.append(d)
    return out


def earlier_values(cls: type[Any]) -> dict[str, Any]:
    """The fields of ``cls`` declared with ``before``, by public name: the value each had in runs made before it
    existed."""
    return {d.name: d.before for d in fields_of(cls) if d.before is not _UNSET}


def instance(cls: type[P], values: Mapping[str, Any]) -> P:
    """The parameters class built from ``values`` by public name (values already checked)."""
    return cls(**{d.attribute: values[d.name] for d in fields_of(cls)})

"""Algorithms by name, with composition: ``base`` or ``base+reg1+reg2``.

A base algorithm module calls :func:`register`; a regularizer module (``asd``) calls
:func:`register_regularizer`. Each declares its parameters with defaults and a rule, and
:func:`resolve` validates a user's parameters against the union, naming any bad one. Every
module of this package is imported on first use, so a new algorithm is one new file (and its
test): nothing here names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wafl.common.algorithms.base import Algorithm, LossTerm
from wafl.common.registry import Registry


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

#: the named rules by their text, which a :class:`Param` may give instead of the rule
RULES: dict[str, ParamRule] = {
    r.text: r for r in (POSITIVE, NON_NEGATIVE, UNIT, UNIT_FROM_ZERO, OPEN_UNIT, COUNT, POSITIVE_COUNT, FLAG)
}


def rule_of(text: str) -> ParamRule:
    """The rule a text names: one of :data:`RULES`, or ``"a|b|..."`` for a :class:`Choice`; raises
    ``ValueError`` for any other text (when the algorithm registers, not when a user's value is checked)."""
    if "|" in text:
        return Choice(tuple(text.split("|")))
    if text not in RULES:
        raise ValueError(f"parameter rule {text!r} is not one of {sorted(RULES)} nor a choice 'a|b'")
    return RULES[text]


@dataclass(frozen=True)
class Param:
    """A declared parameter: its default and the rule a given value must meet (a rule, or its text:
    ``"> 0"``, ``">= 0"``, ``"(0, 1]"``, ``"bool"``, ``"model|layer"``, ...; :func:`rule_of`)."""

    default: Any
    rule: ParamRule | str
    checker: ParamRule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checker", rule_of(self.rule) if isinstance(self.rule, str) else self.rule)

    def check(self, name: str, value: Any) -> Any:
        """The value as the algorithm takes it (a number, an int, a bool, a choice); raises ``ValueError``
        naming ``params.<name>`` and the rule."""
        return self.checker.check(name, value)


Builder = Callable[[dict[str, Any], Mapping[str, Any]], Algorithm]
RegBuilder = Callable[[dict[str, Any]], list[LossTerm]]

# each algorithm's module registers itself (every module of this package is imported on first read)
_BASES: Registry[tuple[dict[str, Param], Builder]] = Registry("algorithm", "wafl.common.algorithms")
_REGULARIZERS: Registry[tuple[dict[str, Param], RegBuilder]] = Registry("regularizer", "wafl.common.algorithms")


def register(name: str, params: dict[str, Param], build: Builder) -> None:
    _BASES.add(name, (params, build))


def register_regularizer(name: str, params: dict[str, Param], build: RegBuilder) -> None:
    _REGULARIZERS.add(name, (params, build))


def names() -> tuple[list[str], list[str]]:
    return _BASES.names(), _REGULARIZERS.names()


def resolve(name: str, params: Mapping[str, Any] | None = None, run: Mapping[str, Any] | None = None) -> Algorithm:
    """Builds the algorithm ``name`` (e.g. ``fedprox+asd``) with validated parameters.

    ``run`` is the run configuration as a mapping, for parts that depend on it (FedDyn's number
    of clients). Raises ``ValueError`` naming the unknown algorithm or the bad parameter.
    """
    base, *regs = name.split("+")
    if base not in _BASES:
        raise ValueError(f"algorithm={name!r}: {base!r} is not one of {_BASES.names()}")
    for r in regs:
        if r not in _REGULARIZERS:
            raise ValueError(f"algorithm={name!r}: regularizer {r!r} is not one of {_REGULARIZERS.names()}")
    if len(set(regs)) != len(regs):
        raise ValueError(f"algorithm={name!r} repeats a regularizer")
    declared: dict[str, Param] = dict(_BASES[base][0])
    for r in regs:
        declared.update(_REGULARIZERS[r][0])
    given = dict(params or {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise ValueError(f"params {unknown} do not apply to algorithm={name!r}; its parameters are {sorted(declared)}")
    resolved = {k: p.check(k, given[k]) if k in given else p.default for k, p in declared.items()}
    algo = _BASES[base][1](resolved, run or {})
    for r in regs:
        algo.add_terms(_REGULARIZERS[r][1](resolved))
    algo.name = name
    algo.params = resolved
    return algo

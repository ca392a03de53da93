"""Algorithms by name, with composition: ``base`` or ``base+reg1+reg2``.

A base algorithm module calls :func:`register`; a regularizer module (``asd``) calls
:func:`register_regularizer`. Each declares its parameters with defaults and a rule, and
:func:`resolve` validates a user's parameters against the union, naming any bad one. Every
module of this package is imported on first use, so a new algorithm is one new file (and its
test): nothing here names it.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from wafl.common.algorithms.base import Algorithm, LossTerm


@dataclass(frozen=True)
class Param:
    default: Any
    rule: str  # "> 0", ">= 0", "(0, 1]", "bool", "model|layer", ...

    def check(self, name: str, value: Any) -> Any:
        r = self.rule
        if r == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                return value.lower() in ("true", "1")
            raise ValueError(f"params.{name}={value!r} must be true or false")
        if "|" in r:
            if value not in r.split("|"):
                raise ValueError(f"params.{name}={value!r} must be one of {r.split('|')}")
            return value
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"params.{name}={value!r} must be a number {r}") from None
        ok = (
            math.isfinite(v)
            and {
                "> 0": v > 0,
                ">= 0": v >= 0,
                "(0, 1]": 0 < v <= 1,
                "[0, 1)": 0 <= v < 1,
                "(0, 1)": 0 < v < 1,
                "int >= 0": v >= 0 and v.is_integer(),
                "int >= 1": v >= 1 and v.is_integer(),
            }[r]
        )
        if not ok:
            raise ValueError(f"params.{name}={value!r} must be {r}")
        return int(v) if r.startswith("int") else v


Builder = Callable[[dict[str, Any], Mapping[str, Any]], Algorithm]
RegBuilder = Callable[[dict[str, Any]], list[LossTerm]]

_BASES: dict[str, tuple[dict[str, Param], Builder]] = {}
_REGULARIZERS: dict[str, tuple[dict[str, Param], RegBuilder]] = {}
_loaded = False


def register(name: str, params: dict[str, Param], build: Builder) -> None:
    _BASES[name] = (params, build)


def register_regularizer(name: str, params: dict[str, Param], build: RegBuilder) -> None:
    _REGULARIZERS[name] = (params, build)


def _load() -> None:
    global _loaded
    if not _loaded:
        import wafl.common.algorithms as package

        for m in sorted(i.name for i in pkgutil.iter_modules(package.__path__)):
            importlib.import_module(f"wafl.common.algorithms.{m}")
        _loaded = True


def names() -> tuple[list[str], list[str]]:
    _load()
    return sorted(_BASES), sorted(_REGULARIZERS)


def resolve(name: str, params: Mapping[str, Any] | None = None, run: Mapping[str, Any] | None = None) -> Algorithm:
    """Builds the algorithm ``name`` (e.g. ``fedprox+asd``) with validated parameters.

    ``run`` is the run configuration as a mapping, for parts that depend on it (FedDyn's number
    of clients). Raises ``ValueError`` naming the unknown algorithm or the bad parameter.
    """
    _load()
    base, *regs = name.split("+")
    if base not in _BASES:
        raise ValueError(f"algorithm={name!r}: {base!r} is not one of {sorted(_BASES)}")
    for r in regs:
        if r not in _REGULARIZERS:
            raise ValueError(f"algorithm={name!r}: regularizer {r!r} is not one of {sorted(_REGULARIZERS)}")
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

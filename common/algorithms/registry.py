"""Algorithms by name, with composition: ``base`` or ``base+reg1+reg2``.

A base algorithm module calls :func:`register`; a regularizer module (``asd``) calls
:func:`register_regularizer`. Each declares its parameters as one frozen dataclass whose fields carry
their defaults and rules (:mod:`wafl.common.algorithms.params`), and :func:`resolve` validates a user's
parameters against the union, naming any bad one, and hands each builder its dataclass. Every module of
this package is imported on first use, so a new algorithm is one new file (and its test): nothing here
names it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias, TypeVar

from wafl.common.algorithms.base import Algorithm, LossTerm
from wafl.common.algorithms.params import Declared, earlier_values, fields_of, instance
from wafl.common.registry import Registry

P = TypeVar("P")

#: builds a base algorithm from its parameters and the run configuration (as a mapping)
Builder: TypeAlias = Callable[[P, Mapping[str, Any]], Algorithm]
#: a regularizer's loss terms from its parameters
RegBuilder: TypeAlias = Callable[[P], list[LossTerm]]

# each algorithm's module registers itself (every module of this package is imported on first read)
_BASES: Registry[tuple[type[Any], Builder[Any]]] = Registry("algorithm", "wafl.common.algorithms")
_REGULARIZERS: Registry[tuple[type[Any], RegBuilder[Any]]] = Registry("regularizer", "wafl.common.algorithms")


def register(name: str, params: type[P], build: Builder[P]) -> None:
    """Registers the base algorithm ``name``: its parameters class and the builder that takes an instance of it.
    A class that is not a frozen dataclass of :func:`~wafl.common.algorithms.params.param` fields is refused."""
    fields_of(params)
    _BASES.add(name, (params, build))


def register_regularizer(name: str, params: type[P], build: RegBuilder[P]) -> None:
    """Registers the regularizer ``name`` (``base+name``), as :func:`register` does a base algorithm."""
    fields_of(params)
    _REGULARIZERS.add(name, (params, build))


def names() -> tuple[list[str], list[str]]:
    return _BASES.names(), _REGULARIZERS.names()


def earlier(name: str) -> dict[str, Any]:
    """The parameters of algorithm ``name`` (``base+reg...``) added after runs were made without them, with the
    value each had in those runs (:func:`~wafl.common.algorithms.params.earlier_values`); an unknown name has
    none."""
    base, *regs = name.split("+")
    if base not in _BASES or any(r not in _REGULARIZERS for r in regs):
        return {}
    out: dict[str, Any] = {}
    for cls in [_BASES[base][0], *(_REGULARIZERS[r][0] for r in regs)]:
        out.update(earlier_values(cls))
    return out


def resolve(name: str, params: Mapping[str, Any] | None = None, run: Mapping[str, Any] | None = None) -> Algorithm:
    """Builds the algorithm ``name`` (e.g. ``fedprox+asd``) with validated parameters.

    ``run`` is the run configuration as a mapping, for parts that depend on it (FedDyn's number
    of clients). Raises ``ValueError`` naming the unknown algorithm or the bad parameter. The
    algorithm's ``params`` are the resolved values by public name, the base's fields then each
    regularizer's, in their declared order.
    """
    base, *regs = name.split("+")
    if base not in _BASES:
        raise ValueError(f"algorithm={name!r}: {base!r} is not one of {_BASES.names()}")
    for r in regs:
        if r not in _REGULARIZERS:
            raise ValueError(f"algorithm={name!r}: regularizer {r!r} is not one of {_REGULARIZERS.names()}")
    if len(set(regs)) != len(regs):
        raise ValueError(f"algorithm={name!r} repeats a regularizer")
    base_params, build = _BASES[base]
    declared: dict[str, Declared] = {}
    for cls in [base_params, *(_REGULARIZERS[r][0] for r in regs)]:
        declared.update((d.name, d) for d in fields_of(cls))
    given = dict(params or {})
    unknown = sorted(set(given) - set(declared))
    if unknown:
        raise ValueError(f"params {unknown} do not apply to algorithm={name!r}; its parameters are {sorted(declared)}")
    resolved = {k: d.check(given[k]) if k in given else d.default for k, d in declared.items()}
    algo = build(instance(base_params, resolved), run or {})
    for r in regs:
        reg_params, reg_build = _REGULARIZERS[r]
        algo.add_terms(reg_build(instance(reg_params, resolved)))
    algo.name = name
    algo.params = resolved
    return algo

"""The robust centers: coordinate-wise rules that combine a collection's committed uploads instead of
their weighted mean, registered by the name the configuration's ``aggregator`` gives them.

A center is one function, registered with :func:`register` (in a :class:`~wafl.common.registry.Registry`):
it takes the uploads' values of one tensor (float64, shape ``(uploads, numel)``, clipped; the function may
reorder them in place) and the configuration's ``trim_fraction``, and returns the float64 center of each
coordinate, shape ``(numel,)``.
Its optional ``refuse`` says why it cannot do what it is for with the uploads one aggregation combines
(:func:`check_robust`, run when the configuration is checked). The centers ignore the weights (unless the
algorithm's updates are scaled by them: ``Accumulator.robust``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from wafl.common.registry import Registry

MEAN = "mean"  # the configuration's ``aggregator`` for the weighted mean, folded as the uploads stream in

Combine = Callable[[np.ndarray, float], np.ndarray]  # (values (uploads, numel), trim) -> center (numel,)
Refuse = Callable[[float, int], str | None]  # (trim, uploads per aggregation) -> why it cannot work, or None


def _accepts(trim: float, uploads: int) -> str | None:
    return None


@dataclass(frozen=True)
class RobustCenter:
    """A registered center: how it combines one tensor's values, and when it refuses a configuration."""

    combine: Combine
    refuse: Refuse = _accepts


# by the configuration's ``aggregator``, in registration order; the centers are this module's functions
ROBUST_CENTERS: Registry[RobustCenter] = Registry("aggregator")


def register(name: str, refuse: Refuse = _accepts) -> Callable[[Combine], Combine]:
    """Registers the decorated function as the robust center ``name`` (the ``aggregator`` that selects it)."""

    def add(combine: Combine) -> Combine:
        if name == MEAN:
            raise ValueError(f"aggregator {name!r} is the weighted mean, not a robust center")
        ROBUST_CENTERS.add(name, RobustCenter(combine, refuse))
        return combine

    return add


def center_names() -> list[str]:
    """Every valid ``aggregator``: the weighted mean, then the robust centers."""
    return [MEAN, *ROBUST_CENTERS]


def check_robust(center: str, trim: float, uploads: int) -> str | None:
    """Why a robust ``center`` cannot work with ``uploads`` per aggregation (None when it can, and for any
    other name)."""
    robust = ROBUST_CENTERS.get(center)
    return None if robust is None else robust.refuse(trim, uploads)


def _trims_nothing(trim: float, uploads: int) -> str | None:
    if math.floor(trim * uploads) < 1:
        return (
            f"aggregator=trimmed_mean with trim_fraction={trim:g} trims floor({trim:g} x {uploads}) = 0 values at "
            f"each end of a round of {uploads} uploads: it is the plain mean; set trim_fraction >= {1 / uploads:.3g} "
            "or use more clients per round"
        )
    return None


@register("trimmed_mean", refuse=_trims_nothing)
def trimmed_mean(values: np.ndarray, trim: float) -> np.ndarray:
    """The mean of each coordinate after dropping its ``floor(trim * k)`` largest and smallest of ``k`` values."""
    k = len(values)
    cut = int(math.floor(trim * k))
    values.sort(axis=0)
    return values[cut : k - cut].mean(axis=0)


def _too_few_for_median(trim: float, uploads: int) -> str | None:
    if uploads < 3:
        return (
            f"aggregator=median of {uploads} uploads per round is their mean: it resists no outlier; "
            "use at least 3 clients per round"
        )
    return None


@register("median", refuse=_too_few_for_median)
def median(values: np.ndarray, trim: float) -> np.ndarray:
    """The median of each coordinate (of an even count, the mean of the two middle values); ``trim`` unused."""
    return np.median(values, axis=0)

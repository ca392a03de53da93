"""Differential privacy of FedHKD's noisy hyper-knowledge (the Gaussian mechanism).

A client adds ``N(0, (sigma * S)^2)`` to each element of every shared class mean, with
``S = 2 * zeta / N_j`` the sensitivity of one element of the mean of representations clipped
to ``[-zeta, zeta]`` when one sample of class ``j`` is replaced by another of the same class.
``sigma`` is therefore the noise multiplier, and everything below works in units where the
sensitivity is 1 (noise std = ``sigma``).

* One round = one release per client: each sample lies in exactly one class, so the
  per-class means touch disjoint data and compose in parallel (the guarantee of the round is
  that of one class mean).
* The guarantee is per representation element, as in the FedHKD paper (its function
  ``f_l`` is one coordinate). The whole ``d``-element mean has L2 sensitivity
  ``2 * zeta * sqrt(d) / N_j``, so for a guarantee on the whole vector use the noise
  multiplier ``sigma / sqrt(d)`` (:func:`vector_noise_multiplier`).
* Class counts ``N_j`` and soft predictions are sent without noise and are not covered.
* ``sigma = 0`` gives no privacy at all; the functions here reject it, and FedHKD's
  ``privacy()`` then reports no epsilon (null) with a note that the knowledge is not private.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from scipy.special import log_ndtr

__all__ = [
    "PrivacyReport",
    "analytic_gaussian_delta",
    "epsilon_composed",
    "epsilon_per_release",
    "privacy_report",
    "vector_noise_multiplier",
]


def _check_sigma(sigma: float) -> None:
    if not (isinstance(sigma, numbers.Real) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma={sigma!r} must be a finite number > 0 (sigma = 0 means no privacy: epsilon = inf)")


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, numbers.Real) and 0 < delta < 1):
        raise ValueError(f"delta={delta!r} must lie in (0, 1)")


def _check_releases(releases: int) -> None:
    if isinstance(releases, bool) or not isinstance(releases, numbers.Integral) or releases < 1:
        raise ValueError(f"releases={releases!r} must be an integer >= 1")


def analytic_gaussian_delta(sigma: float, eps: float) -> float:
    """The exact ``delta(eps)`` of the Gaussian mechanism with sensitivity 1 and noise std ``sigma``
    (Balle & Wang 2018, Theorem 8): ``Phi(1/(2s) - eps*s) - e^eps * Phi(-1/(2s) - eps*s)``."""
    _check_sigma(sigma)
    if not eps >= 0:
        raise ValueError(f"eps={eps!r} must be >= 0")
    a = 1.0 / (2.0 * sigma)
    b = eps * sigma
    first = math.exp(float(log_ndtr(a - b)))
    second = math.exp(min(eps + float(log_ndtr(-a - b)), 700.0))
    return max(first - second, 0.0)


def epsilon_per_release(sigma: float, delta: float) -> float:
    """The smallest ``eps`` for which one Gaussian release with noise multiplier ``sigma`` is
    ``(eps, delta)``-DP, by bisection on :func:`analytic_gaussian_delta` (decreasing in ``eps``)."""
    _check_sigma(sigma)
    _check_delta(delta)
    if analytic_gaussian_delta(sigma, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while analytic_gaussian_delta(sigma, hi) > delta:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if analytic_gaussian_delta(sigma, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


def epsilon_composed(sigma: float, delta: float, releases: int) -> float:
    """``eps`` after ``releases`` Gaussian releases, by zero-concentrated DP: each release is
    ``1/(2 sigma^2)``-zCDP, ``rho = releases / (2 sigma^2)``, ``eps = rho + 2 sqrt(rho ln(1/delta))``."""
    _check_sigma(sigma)
    _check_delta(delta)
    _check_releases(releases)
    rho = releases / (2.0 * sigma * sigma)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def vector_noise_multiplier(sigma: float, code_len: int) -> float:
    """The noise multiplier that applies to the whole ``code_len``-element mean: ``sigma / sqrt(code_len)``."""
    _check_sigma(sigma)
    if isinstance(code_len, bool) or not isinstance(code_len, numbers.Integral) or code_len < 1:
        raise ValueError(f"code_len={code_len!r} must be an integer >= 1")
    return sigma / math.sqrt(code_len)


@dataclass(frozen=True)
class PrivacyReport:
    """What a run's noisy hyper-knowledge guarantees, per client."""

    sigma: float
    delta: float
    zeta: float
    sensitivity_note: str
    epsilon_per_release: float
    epsilon_per_run: float
    releases: int
    composition: str


def privacy_report(sigma: float, delta: float, zeta: float, releases: int) -> PrivacyReport:
    """The per-release (analytic Gaussian) and per-run (zCDP over ``releases`` rounds) epsilon."""
    _check_sigma(sigma)
    _check_delta(delta)
    if not (isinstance(zeta, numbers.Real) and math.isfinite(zeta) and zeta > 0):
        raise ValueError(f"zeta={zeta!r} must be a finite number > 0")
    _check_releases(releases)
    note = (
        f"representation elements clipped to [-{zeta:g}, {zeta:g}]; one element of a class mean has "
        f"sensitivity 2*zeta/N_j = {2 * zeta:g}/N_j under replacing one sample of the class; noise std "
        f"= sigma*2*zeta/N_j; the guarantee is per element (the whole d-element mean: use sigma/sqrt(d)); "
        f"classes compose in parallel, one release per client per round; counts and soft predictions "
        f"are not noised"
    )
    return PrivacyReport(
        sigma=float(sigma),
        delta=float(delta),
        zeta=float(zeta),
        sensitivity_note=note,
        epsilon_per_release=epsilon_per_release(sigma, delta),
        epsilon_per_run=epsilon_composed(sigma, delta, releases),
        releases=int(releases),
        composition="zCDP: rho = releases/(2 sigma^2), eps = rho + 2 sqrt(rho ln(1/delta))",
    )

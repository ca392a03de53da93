"""Gaussian-mechanism accounting: analytic per-release epsilon and zCDP composition."""

from __future__ import annotations

import math

import pytest
from wafl.common.privacy import (
    PrivacyReport,
    epsilon_composed,
    epsilon_per_release,
    privacy_report,
    vector_noise_multiplier,
)


def phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def delta_of(eps: float, sigma: float) -> float:
    """Balle & Wang (2018) exact delta of the Gaussian mechanism, sensitivity 1, std sigma."""
    a = 1.0 / (2.0 * sigma)
    return phi(a - eps * sigma) - math.exp(eps) * phi(-a - eps * sigma)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0, 7.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3, 0.01])
def test_analytic_epsilon_is_tight(sigma, delta):
    eps = epsilon_per_release(sigma, delta)
    assert eps > 0
    d = delta_of(eps, sigma)
    assert abs(d - delta) <= 1e-6 * delta
    assert d <= delta * (1 + 1e-9)
    # slightly smaller eps no longer satisfies the condition: it is the smallest
    assert delta_of(eps * (1 - 1e-4), sigma) > delta


def test_analytic_epsilon_known_value():
    # roots of the exact condition found with an independent root finder (scipy brentq);
    # the classical bound would give sqrt(2 ln(1.25e5)) = 4.84 at sigma = 1 and 0.69 at sigma = 7
    assert epsilon_per_release(1.0, 1e-5) == pytest.approx(4.3771781, abs=1e-6)
    assert epsilon_per_release(7.0, 1e-5) == pytest.approx(0.5024792, abs=1e-6)


def test_monotone_in_sigma_and_delta():
    sigmas = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 3.0, 5.0, 7.0, 10.0, 20.0]
    eps = [epsilon_per_release(s, 1e-5) for s in sigmas]
    assert all(a > b for a, b in zip(eps, eps[1:]))
    deltas = [1e-8, 1e-6, 1e-4, 1e-2]
    eps_d = [epsilon_per_release(1.0, d) for d in deltas]
    assert all(a > b for a, b in zip(eps_d, eps_d[1:]))


@pytest.mark.parametrize("delta", [1e-5, 1e-2])
def test_below_classical_bound_where_it_applies(delta):
    c = math.sqrt(2.0 * math.log(1.25 / delta))
    checked = 0
    for sigma in [c * 1.01, c * 1.5, 7.0, 10.0, 50.0]:
        classical = c / sigma
        if classical < 1.0:
            assert epsilon_per_release(sigma, delta) < classical
            checked += 1
    assert checked >= 4


def test_zero_epsilon_when_noise_swamps_signal():
    # 2 Phi(1 / (2 sigma)) - 1 <= delta already at eps = 0
    assert epsilon_per_release(1e4, 0.1) == 0.0


def test_composition_formula_and_growth():
    sigma, delta = 2.0, 1e-5
    rho = 10 / 8
    assert epsilon_composed(sigma, delta, 10) == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)), rel=1e-12)
    eps = [epsilon_composed(sigma, delta, r) for r in (1, 2, 5, 10, 100)]
    assert all(a < b for a, b in zip(eps, eps[1:]))
    # more noise, less loss
    assert epsilon_composed(4.0, delta, 10) < epsilon_composed(2.0, delta, 10)


def test_privacy_report():
    r = privacy_report(7.0, 1e-5, 3.0, 50)
    assert isinstance(r, PrivacyReport)
    assert (r.sigma, r.delta, r.zeta, r.releases) == (7.0, 1e-5, 3.0, 50)
    assert r.epsilon_per_release == epsilon_per_release(7.0, 1e-5)
    assert r.epsilon_per_run == epsilon_composed(7.0, 1e-5, 50)
    assert "zCDP" in r.composition
    assert "2*zeta/N_j" in r.sensitivity_note and "3" in r.sensitivity_note


def test_vector_noise_multiplier():
    assert vector_noise_multiplier(8.0, 16) == pytest.approx(2.0)
    assert epsilon_per_release(vector_noise_multiplier(7.0, 32), 1e-5) > epsilon_per_release(7.0, 1e-5)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: epsilon_per_release(0.0, 1e-5), "sigma=0.0"),
        (lambda: epsilon_per_release(-1.0, 1e-5), "sigma=-1.0"),
        (lambda: epsilon_per_release(float("nan"), 1e-5), "sigma=nan"),
        (lambda: epsilon_per_release(1.0, 0.0), "delta=0.0"),
        (lambda: epsilon_per_release(1.0, 1.0), "delta=1.0"),
        (lambda: epsilon_composed(1.0, 1.5, 3), "delta=1.5"),
        (lambda: epsilon_composed(1.0, 1e-5, 0), "releases=0"),
        (lambda: epsilon_composed(1.0, 1e-5, 2.5), "releases=2.5"),
        (lambda: privacy_report(1.0, 1e-5, 0.0, 3), "zeta=0.0"),
        (lambda: privacy_report(1.0, 1e-5, -2.0, 3), "zeta=-2.0"),
        (lambda: privacy_report(0.0, 1e-5, 3.0, 3), "sigma=0.0"),
        (lambda: privacy_report(1.0, 1e-5, 3.0, 0), "releases=0"),
        (lambda: vector_noise_multiplier(1.0, 0), "code_len=0"),
    ],
)
def test_bad_params_raise(call, name):
    with pytest.raises(ValueError, match=name):
        call()

"""The curvature estimators (wafl.common.analysis.hessian) against the exact Hessian of tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from wafl.common.analysis.hessian import (
    HessianOperator,
    hutchinson_trace,
    lanczos_density,
    plot_density,
    top_eigenvalue,
)


def tiny() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A 2-4-3 tanh MLP (27 parameters) on 12 points in two batches, in float64."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(12, 2, dtype=torch.float64) * 2
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 1, 1, 0])
    return model, [(x[:7], y[:7]), (x[7:], y[7:])]


def exact_hessian(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The Hessian of the mean cross-entropy over every point, by torch.autograd.functional.hessian."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])

    def loss(v: torch.Tensor) -> torch.Tensor:
        params, i = {}, 0
        for n, s in zip(names, shapes):
            k = int(np.prod(s))
            params[n] = v[i : i + k].view(s)
            i += k
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    return torch.autograd.functional.hessian(loss, flat)


def test_hvp_is_the_exact_hessian_times_v() -> None:
    model, batches = tiny()
    H = exact_hessian(model, batches)
    op = HessianOperator(model, batches)
    assert op.dim == 27 and op.total == 12
    v = torch.randn(27, dtype=torch.float64)
    assert torch.allclose(op.hvp(v), H @ v, atol=1e-10)


def test_power_iteration_finds_the_top_eigenvalue() -> None:
    model, batches = tiny()
    eig = torch.linalg.eigvalsh(exact_hessian(model, batches))
    assert eig[-1] > abs(eig[0])  # the top eigenvalue is the one of largest magnitude here
    got = top_eigenvalue(HessianOperator(model, batches), max_iter=1000, tol=1e-10)
    assert got.converged
    assert got.value == pytest.approx(float(eig[-1]), rel=1e-6)
    loose = top_eigenvalue(HessianOperator(model, batches), max_iter=2, tol=1e-12)
    assert not loose.converged and loose.iterations == 2


def test_hutchinson_trace_within_its_standard_error() -> None:
    model, batches = tiny()
    exact = float(torch.trace(exact_hessian(model, batches)))
    est = hutchinson_trace(HessianOperator(model, batches), probes=400, seed=1)
    assert est.probes == 400 and len(est.samples) == 400
    assert est.stderr > 0
    assert abs(est.mean - exact) < 4 * est.stderr
    # the standard error is the sample standard deviation over sqrt(probes)
    assert est.stderr == pytest.approx(float(np.std(est.samples, ddof=1) / np.sqrt(400)))


class Scaled(nn.Module):
    """``out = w * x`` elementwise: with the loss sum(out^2)/2 per sample, ``H = diag(mean x^2)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 2, 6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * x


def test_hutchinson_is_exact_for_a_diagonal_hessian() -> None:
    x = torch.arange(1, 25, dtype=torch.float64).view(4, 6) / 7
    batches = [(x[:3], torch.zeros(3)), (x[3:], torch.zeros(1))]
    op = HessianOperator(Scaled(), batches, loss=lambda out, y: (out**2).sum(1).mean() / 2)
    exact = float((x**2).mean(0).sum())
    est = hutchinson_trace(op, probes=5, seed=0)
    assert est.mean == pytest.approx(exact, rel=1e-12)
    assert est.stderr == pytest.approx(0.0, abs=1e-12)
    assert top_eigenvalue(op, max_iter=500, tol=1e-12).value == pytest.approx(float((x**2).mean(0).max()), rel=1e-6)


def test_lanczos_with_full_steps_recovers_the_spectrum() -> None:
    model, batches = tiny()
    eig = torch.linalg.eigvalsh(exact_hessian(model, batches)).numpy()
    d = lanczos_density(HessianOperator(model, batches), steps=27, runs=1, seed=0)
    nodes = d.nodes[0][d.weights[0] > 0]
    assert np.allclose(d.weights.sum(axis=1), 1.0)
    assert min(abs(nodes - eig.max())) < 1e-8 and min(abs(nodes - eig.min())) < 1e-8
    assert all(min(abs(eig - t)) < 1e-8 for t in nodes)  # every node is an eigenvalue


def test_slq_density_integrates_to_one_and_its_mean_is_trace_over_n(tmp_path) -> None:
    model, batches = tiny()
    H = exact_hessian(model, batches)
    d = lanczos_density(HessianOperator(model, batches), steps=10, runs=300, seed=2)
    assert np.trapezoid(d.values, d.grid) == pytest.approx(1.0, abs=1e-3)
    per_run = (d.nodes * d.weights).sum(axis=1)  # each is v^T H v / |v|^2 for its Gaussian probe
    stderr = per_run.std(ddof=1) / np.sqrt(len(per_run))
    assert abs(d.mean() - float(torch.trace(H)) / 27) < 4 * stderr
    # the smoothed density's mean is the quadrature's mean
    assert np.trapezoid(d.grid * d.values, d.grid) == pytest.approx(d.mean(), abs=1e-3 * abs(d.grid).max())
    out = tmp_path / "density.png"
    plot_density(d, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_refused() -> None:
    model, batches = tiny()
    op = HessianOperator(model, batches)
    with pytest.raises(ValueError, match="probes"):
        hutchinson_trace(op, probes=0)
    with pytest.raises(ValueError, match="max_iter"):
        top_eigenvalue(op, max_iter=0)
    with pytest.raises(ValueError, match="batch"):
        HessianOperator(model, [])

"""Curvature of a model's loss from Hessian-vector products: top eigenvalue, trace, spectral density.

The loss is the mean cross-entropy of a model over fixed batches (:class:`HessianOperator`); its
Hessian with respect to the model's trainable parameters is never formed. Each product ``H v``
is a double backward pass per batch (Pearlmutter's trick: the gradient of ``g . v``), the
batches weighted by their sizes, so memory holds one batch's graph at a time. The estimators
follow PyHessian (Yao et al., 2020):

* :func:`top_eigenvalue`: power iteration on ``H`` until the eigenvalue estimate changes by less
  than ``tol`` relatively (or ``max_iter`` products). It converges to the eigenvalue of largest
  magnitude, the top one at a minimum, where the large eigenvalues are positive.
* :func:`hutchinson_trace`: ``tr(H) = E[z^T H z]`` over Rademacher probes ``z``; the mean of
  ``probes`` samples with its standard error (sample standard deviation / sqrt(probes)).
* :func:`lanczos_density`: stochastic Lanczos quadrature. For each of ``runs`` Gaussian probes,
  ``steps`` Lanczos iterations with full reorthogonalisation give a tridiagonal ``T``; its
  eigenvalues are the quadrature nodes and the squared first components of its eigenvectors
  the weights (they sum to 1). The density is the average over probes of the weights spread
  by a Gaussian of width ``sigma``; it integrates to 1 and its mean is ``tr(H) / n`` in
  expectation. :func:`plot_density` draws it (log scale) as a PNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.errors import InvariantError

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> mean loss


class HessianOperator:
    """``v -> H v`` for the mean ``loss`` of ``model`` over ``batches`` (each ``(x, y)``), with respect
    to the model's trainable parameters (flattened into one vector of length :attr:`dim`).

    The model is put in evaluation mode (no dropout, batch norm on its running statistics), so
    every product is of one deterministic function; the batches are used as given, each time."""

    def __init__(
        self, model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss: Loss = F.cross_entropy
    ) -> None:
        if not batches:
            raise ValueError("the Hessian needs at least one batch of data")
        self.model = model.eval()
        self.batches = list(batches)
        self.loss = loss
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.dim = sum(p.numel() for p in self.params)
        self.total = sum(len(y) for _, y in self.batches)
        self.products = 0  # Hessian-vector products computed so far
        p0 = self.params[0]
        self.device, self.dtype = p0.device, p0.dtype

    def _split(self, v: torch.Tensor) -> list[torch.Tensor]:
        out, i = [], 0
        for p in self.params:
            out.append(v[i : i + p.numel()].view_as(p))
            i += p.numel()
        return out

    def _flat(self, parts: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """One flat vector of per-parameter tensors (None, for a parameter the loss does not use: zeros)."""
        flat = [(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(parts, self.params)]
        return torch.cat(flat)

    def value(self) -> float:
        """The mean loss over every batch."""
        with torch.no_grad():
            return sum(float(self.loss(self.model(x), y)) * len(y) for x, y in self.batches) / self.total

    def gradient(self) -> torch.Tensor:
        """The gradient of the mean loss, flattened."""
        g = torch.zeros(self.dim, device=self.device, dtype=self.dtype)
        for x, y in self.batches:
            loss = self.loss(self.model(x), y) * (len(y) / self.total)
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            g += self._flat(grads)
        return g

    def hvp(self, v: torch.Tensor) -> torch.Tensor:
        """``H v`` for a flat vector ``v`` of length :attr:`dim`."""
        parts = self._split(v.to(self.device, self.dtype))
        out = torch.zeros(self.dim, device=self.device, dtype=self.dtype)
        for x, y in self.batches:
            loss = self.loss(self.model(x), y) * (len(y) / self.total)
            grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
            dot = sum((g * u).sum() for g, u in zip(grads, parts) if g is not None and g.requires_grad)
            if isinstance(dot, torch.Tensor):  # else the loss is linear in every parameter: H v = 0
                out += self._flat(torch.autograd.grad(dot, self.params, allow_unused=True))
        self.products += 1
        return out.detach()


@dataclass(frozen=True)
class Eigenvalue:
    value: float
    iterations: int
    converged: bool  # the relative change fell below the tolerance before max_iter


@dataclass(frozen=True)
class TraceEstimate:
    mean: float
    stderr: float  # sample standard deviation of the probes' values / sqrt(probes); 0 for one probe
    probes: int
    samples: tuple[float, ...]


@dataclass(frozen=True)
class Density:
    nodes: np.ndarray  # (runs, steps): Ritz values of each probe's Lanczos run
    weights: np.ndarray  # (runs, steps): their quadrature weights; each row sums to 1
    grid: np.ndarray  # eigenvalues at which the smoothed density is given
    values: np.ndarray  # the density on the grid
    sigma: float  # width of the Gaussian that spreads each node

    def mean(self) -> float:
        """The quadrature's estimate of ``tr(H) / n``: the weighted mean of the nodes over the runs."""
        return float((self.nodes * self.weights).sum(axis=1).mean())


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def top_eigenvalue(op: HessianOperator, max_iter: int = 100, tol: float = 1e-3, seed: int = 0) -> Eigenvalue:
    """The eigenvalue of ``H`` of largest magnitude by power iteration from a seeded Gaussian vector."""
    if max_iter < 1:
        raise ValueError(f"max_iter={max_iter} must be at least 1")
    if not tol > 0:
        raise ValueError(f"tol={tol} must be positive")
    v = torch.randn(op.dim, generator=_generator(seed, op.device), device=op.device, dtype=op.dtype)
    v /= v.norm()
    value: float | None = None
    for i in range(1, max_iter + 1):
        hv = op.hvp(v)
        new = float(v @ hv)  # Rayleigh quotient of the unit vector v
        norm = hv.norm()
        if value is not None and abs(new - value) / (abs(value) + 1e-6) < tol:
            return Eigenvalue(new, i, True)
        value = new
        if norm == 0:
            return Eigenvalue(0.0, i, True)
        v = hv / norm
    if value is None:  # max_iter >= 1: the loop ran
        raise InvariantError("power iteration ran no step")
    return Eigenvalue(value, max_iter, False)


def rademacher(n: int, generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=generator, device=device).to(dtype) * 2 - 1


def hutchinson_trace(op: HessianOperator, probes: int = 100, seed: int = 0) -> TraceEstimate:
    """``tr(H)`` as the mean of ``z^T H z`` over ``probes`` seeded Rademacher vectors ``z``."""
    if probes < 1:
        raise ValueError(f"probes={probes} must be at least 1")
    gen = _generator(seed, op.device)
    samples = []
    for _ in range(probes):
        z = rademacher(op.dim, gen, op.device, op.dtype)
        samples.append(float(z @ op.hvp(z)))
    mean = sum(samples) / probes
    var = sum((s - mean) ** 2 for s in samples) / (probes - 1) if probes > 1 else 0.0
    return TraceEstimate(mean, math.sqrt(var / probes), probes, tuple(samples))


def lanczos(op: HessianOperator, steps: int, v0: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(alpha, beta)``: the diagonal and off-diagonal of the tridiagonal matrix of ``steps`` Lanczos
    iterations from ``v0`` with full reorthogonalisation (fewer when an invariant subspace is found)."""
    steps = min(steps, op.dim)
    basis: list[torch.Tensor] = [v0 / v0.norm()]
    alpha: list[float] = []
    beta: list[float] = []
    for j in range(steps):
        w = op.hvp(basis[j])
        a = float(w @ basis[j])
        alpha.append(a)
        if j == steps - 1:
            break
        Q = torch.stack(basis)
        for _ in range(2):  # twice is enough (Giraud et al.): the basis stays orthonormal to rounding
            w = w - Q.T @ (Q @ w)
        b = float(w.norm())
        if b < 1e-10 * max(1.0, abs(a)):
            break  # the Krylov space is invariant: T's eigenvalues are exact eigenvalues of H
        beta.append(b)
        basis.append(w / b)
    return np.asarray(alpha), np.asarray(beta)


def lanczos_density(
    op: HessianOperator,
    steps: int = 90,
    runs: int = 1,
    seed: int = 0,
    sigma: float | None = None,
    points: int = 10_000,
) -> Density:
    """Stochastic Lanczos quadrature of the eigenvalue density of ``H`` (module docstring). ``sigma``
    defaults to 1% of the span of the nodes; the grid extends 5 ``sigma`` past the extreme nodes."""
    if steps < 1 or runs < 1:
        raise ValueError(f"steps={steps} and runs={runs} must be at least 1")
    gen = _generator(seed, op.device)
    m = min(steps, op.dim)
    nodes = np.zeros((runs, m))
    weights = np.zeros((runs, m))
    for r in range(runs):
        v0 = torch.randn(op.dim, generator=gen, device=op.device, dtype=op.dtype)
        alpha, beta = lanczos(op, m, v0)
        theta, vecs = np.linalg.eigh(np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1))
        k = len(theta)
        nodes[r, :k], weights[r, :k] = theta, vecs[0] ** 2  # unused slots keep weight 0
        nodes[r, k:] = theta[-1]
    lo, hi = float(nodes.min()), float(nodes.max())
    width = sigma if sigma is not None else max(0.01 * (hi - lo), 1e-6 * max(1.0, abs(hi)))
    if not width > 0:
        raise ValueError(f"sigma={sigma} must be positive")
    grid = np.linspace(lo - 5 * width, hi + 5 * width, points)
    values = np.zeros_like(grid)
    for th, w in zip(nodes.reshape(-1), weights.reshape(-1)):
        if w > 0:
            values += w * np.exp(-((grid - th) ** 2) / (2 * width**2))
    values /= runs * width * math.sqrt(2 * math.pi)
    return Density(nodes, weights, grid, values, width)


def plot_density(density: Density, path: str, title: str = "") -> None:
    """The density on a log scale against the eigenvalue, as PyHessian and the ASD paper draw it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    floor = max(float(density.values.max()) * 1e-12, 1e-300)
    ax.semilogy(density.grid, np.maximum(density.values, floor))
    ax.set_xlabel("eigenvalue")
    ax.set_ylabel("density (log scale)")
    ax.set_title(title or f"Hessian eigenvalue density (SLQ, sigma={density.sigma:.3g})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

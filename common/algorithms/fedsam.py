"""FedSAM (Qu, Li, Duan, Liu, Tang and Lu, "Generalized Federated Learning via Sharpness Aware
Minimization", ICML 2022): FedAvg whose local optimizer is sharpness-aware minimisation.

Each local step, on one batch with loss ``f``: ``g = grad f(w)``, the ascent
``e = rho * g / ||g||_2`` (one norm over every trained parameter), then the descent with the
gradient at the perturbed point, ``w <- w - eta * grad f(w + e)`` (through the run's optimizer,
so momentum and weight decay apply to that gradient as in the authors' SAM wrapper). ``rho``
0.05. The server is FedAvg. The step rule (:class:`SamStep`) is shared with FedSpeed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, Phase, StepContext, StepRule
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register


def ascent(params: list[nn.Parameter], grads: list[torch.Tensor | None], rho: float) -> list[torch.Tensor]:
    """Adds ``e = rho g / ||g||`` to ``params`` in place and returns ``e`` per parameter."""
    total = sum((g.double() ** 2).sum() for g in grads if g is not None)
    if not isinstance(total, torch.Tensor):
        raise ValueError("ascent needs at least one gradient")
    norm = torch.sqrt(total)
    scale = rho / (float(norm) + 1e-12)
    out = []
    with torch.no_grad():
        for p, g in zip(params, grads):
            e = torch.zeros_like(p) if g is None else g * scale
            p.add_(e)
            out.append(e)
    return out


def gradients(loss: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(loss, params, allow_unused=True))


def sharpness_gradients(
    closure: Callable[[], torch.Tensor], params: list[nn.Parameter], rho: float
) -> tuple[torch.Tensor, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The loss at ``w``, its gradient ``g`` and the gradient at ``w + rho g / ||g||``; ``params``
    are back at ``w`` afterwards (SAM's two passes, shared by FedSAM and FedSpeed)."""
    loss = closure()
    g = gradients(loss, params)
    saved = [p.detach().clone() for p in params]
    ascent(params, g, rho)
    perturbed = gradients(closure(), params)
    with torch.no_grad():
        for p, w in zip(params, saved):
            p.copy_(w)
    return loss, g, perturbed


class SamStep(StepRule):
    def __init__(self, rho: float) -> None:
        self.rho = rho

    def step(self, ctx: StepContext) -> torch.Tensor:
        loss, _, perturbed = sharpness_gradients(ctx.closure, ctx.params, self.rho)
        ctx.optimizer.zero_grad(set_to_none=True)
        for p, g in zip(ctx.params, perturbed):
            p.grad = None if g is None else g.detach()
        ctx.optimizer.step()
        return loss


@dataclass(frozen=True)
class FedSAMParams:
    rho: float = param(0.05, "> 0")


def build(p: FedSAMParams, run: Mapping[str, Any]) -> Algorithm:
    return Algorithm("fedsam", phases=[Phase("gm", step=SamStep(p.rho))])


register("fedsam", FedSAMParams, build)

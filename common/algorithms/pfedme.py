"""pFedMe (Dinh, Tran and Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020).

Client ``i`` keeps a local model ``w_i`` and a personal model ``theta_i`` (the PM); both start
each round from the received global ``w``, as in the authors' code (``set_parameters`` copies the
global model into the personal and the local model). For each batch ``D_b``:

    theta_i ~= argmin_theta f_i(theta; D_b) + (lambda/2) ||theta - w_i||^2     (K gradient steps
               of size personal_lr from the current theta_i, as the authors' optimizer)
    w_i <- w_i - eta * lambda * (w_i - theta_i)

(``eta`` and the second step through the run's optimizer: with plain SGD without weight decay
this is the paper's update). The client uploads ``w_i``; the server takes ``w <- (1 - beta) w + beta * mean_i w_i``
(sample weights). The personal model is ``theta_i``; its wait-free phase keeps solving the
inner problem ``f_i(theta) + (lambda/2) ||theta - w_i||^2`` for the local model it holds until
the next broadcast (``pm_epochs`` under compute-and-wait). An unselected client does not train
(``theta`` is tied to the local rounds). Defaults: ``lambda`` 15, ``personal_lr`` 0.01, ``K`` 5
(the paper's), ``beta`` 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.algorithms.base import (
    Algorithm,
    AlgorithmStateError,
    Forward,
    LossTerm,
    Phase,
    RoundContext,
    ServerUpdate,
    StepContext,
    StepRule,
)
from wafl.common.algorithms.registry import Param, register
from wafl.common.algorithms.server_updates import is_weight


class MoreauStep(StepRule):
    def __init__(self, lam: float, personal_lr: float, k: int) -> None:
        self.lam, self.personal_lr, self.k = lam, personal_lr, k
        self.theta: nn.Module | None = None

    def begin(self, ctx: RoundContext, model: nn.Module, params: list[nn.Parameter]) -> None:
        if ctx.pm is None:
            raise AlgorithmStateError("pfedme: the Moreau step needs the personal model theta; none was built")
        self.theta = ctx.pm
        with torch.no_grad():  # theta approximates argmin f_i + (lambda/2)||theta - w||^2 from w on
            for t, w in zip(self.theta.parameters(), params):
                t.copy_(w)

    def step(self, ctx: StepContext) -> torch.Tensor:
        if self.theta is None:
            raise AlgorithmStateError("pfedme: the Moreau step was called before its phase began (no personal model)")
        x, y = ctx.batch
        theta = list(self.theta.parameters())
        self.theta.train()
        for _ in range(self.k):
            loss = F.cross_entropy(self.theta(x), y)
            grads = torch.autograd.grad(loss, theta)
            with torch.no_grad():
                for t, g, w in zip(theta, grads, ctx.params):
                    t.sub_(self.personal_lr * (g + self.lam * (t - w)))
        ctx.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for w, t in zip(ctx.params, theta):
                w.grad = self.lam * (w.detach() - t.detach())
        ctx.optimizer.step()
        return loss.detach()


class ProximalToLocal(LossTerm):
    """``(lambda/2) ||theta - w_i||^2`` towards the client's local model (frozen)."""

    name = "pfedme_prox"

    def __init__(self, lam: float) -> None:
        self.lam = lam

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        # A tensor, not the start value 0: the model has parameters.
        dist = sum(((t - w.detach()) ** 2).sum() for t, w in zip(model.parameters(), ctx.gm.parameters()))
        return 0.5 * self.lam * cast(torch.Tensor, dist)


class PFedMeServer(ServerUpdate):
    buffered_ok = False

    def __init__(self, beta: float) -> None:
        self.beta = beta

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        out = dict(mean)
        for k, w in prev.items():
            if is_weight(k, w):
                out[k] = (1 - self.beta) * w + self.beta * mean[k].to(w.dtype)
        return out


def build(p: dict[str, Any], run: Mapping[str, Any]) -> Algorithm:
    return Algorithm(
        "pfedme",
        p,
        phases=[Phase("gm", step=MoreauStep(p["lambda"], p["personal_lr"], p["k"]))],
        server=PFedMeServer(p["beta"]),
        personal="separate",
        pm_phase=Phase("pm", terms=[ProximalToLocal(p["lambda"])], main=False),
    )


register(
    "pfedme",
    {
        "lambda": Param(15.0, "> 0"),
        "personal_lr": Param(0.01, "> 0"),
        "k": Param(5, "int >= 1"),
        "beta": Param(1.0, "> 0"),
    },
    build,
)

"""FedSpeed (Sun, Shen, Huang, Ding and Tao, "FedSpeed: Larger Local Interval, Less Communication
Round, and Higher Generalization Accuracy", ICLR 2023): prox-corrected local steps with a dual
variable and a merged gradient-perturbation (SAM-like) gradient; the client's steps are the paper's
Algorithm 1, the server's step is Algorithm 1's or the authors' code's (``dual_mean``).

Client ``i`` with local dual ``g_hat_i`` (zero at first; client state, persists across rounds
and restarts) starts from the global ``x`` and, for each batch, at ``x_k``:

    g1 = grad f(x_k),   x~ = x_k + rho * g1 / ||g1||,   g2 = grad f(x~),   g = (1 - alpha) g1 + alpha g2
    x_{k+1} = x_k - eta * (g - g_hat_i + (x_k - x) / lambda)

(the corrected gradient goes through the run's optimizer: with plain SGD without weight decay
this is the step above). After the local steps, ``g_hat_i <- g_hat_i - (x_K - x) / lambda``.

The server's step, ``dual_mean``:

- ``"participants"`` (the default; the paper's Algorithm 1): the client uploads
  ``x_hat_i = x_K - lambda * g_hat_i`` and the server averages the uploads (sample weights, as FedAvg here;
  the paper's mean is uniform over the round's clients, the same for equal shards):
  ``x <- mean_S(x_K - lambda * g_hat_i)``.
- ``"all"`` (the authors' code, ``woodenchild95/FL-Simulator`` ``server/FedSpeed.py``, and ASD's,
  ``train_fed_speed``): the client uploads ``x_K`` and the server keeps the mean of every training
  client's dual, ``x <- mean_S(x_K) - lambda * (1/m) sum_{i=1..m} g_hat_i`` (uniform mean over the round's
  clients; ``m``: all training clients, whose duals the server tracks from their uploads as FedDyn's ``h``:
  :class:`~wafl.common.algorithms.feddyn.FedDynUpdate` with ``alpha = 1/lambda``). The two agree when every
  client takes part each round. With a few clients a round the participants' mean weights each client's dual
  ``m/|S|`` times as much: at 500 clients with 5 a round, FedSpeed's global model under it fell from about 80 %
  at round 400 to 72 % over the last 10 of 1,000 rounds on Fashion-MNIST (``asd_fmnist_500_plateau``,
  seeds 0 and 1, before ``dual_mean`` existed).

Defaults chosen on digits (the paper tunes per data set): ``lambda`` 10 (a proximal coefficient of 0.1),
``alpha`` 0.5, ``rho`` 0.05.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, Phase, RoundContext, StepContext, StepRule
from wafl.common.algorithms.feddyn import FedDynUpdate
from wafl.common.algorithms.fedsam import sharpness_gradients
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.server_updates import training_clients

STATE_KEY = "fedspeed_dual"


class FedSpeedStep(StepRule):
    def __init__(self, lam: float, alpha: float, rho: float, upload_dual: bool = True) -> None:
        self.lam, self.alpha, self.rho = lam, alpha, rho
        self.upload_dual = upload_dual  # upload x_K - lambda * g_hat (dual_mean "participants"), else x_K

    def begin(self, ctx: RoundContext, model: nn.Module, params: list[nn.Parameter]) -> None:
        self.start = [p.detach().clone() for p in params]
        saved = ctx.client_state.get(STATE_KEY)
        self.dual = [d.to(p.device) for d, p in zip(saved, params)] if saved else [torch.zeros_like(p) for p in params]

    def step(self, ctx: StepContext) -> torch.Tensor:
        loss, g1, g2 = sharpness_gradients(ctx.closure, ctx.params, self.rho)
        ctx.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, a, b, d, x in zip(ctx.params, g1, g2, self.dual, self.start):
                w = p.detach()
                a = torch.zeros_like(p) if a is None else a
                b = torch.zeros_like(p) if b is None else b
                p.grad = (1 - self.alpha) * a + self.alpha * b - d + (w - x) / self.lam
        ctx.optimizer.step()
        return loss

    def end(self, ctx: RoundContext, model: nn.Module, params: list[nn.Parameter]) -> None:
        with torch.no_grad():
            self.dual = [d - (p.detach() - x) / self.lam for d, p, x in zip(self.dual, params, self.start)]
            if self.upload_dual:
                for p, d in zip(params, self.dual):
                    p.sub_(self.lam * d)  # the model the client uploads: x_hat = x_K - lambda * g_hat
        ctx.client_state[STATE_KEY] = [d.cpu() for d in self.dual]


@dataclass(frozen=True)
class FedSpeedParams:
    lambda_: float = param(10.0, "> 0", name="lambda")
    alpha: float = param(0.5, "[0, 1)")
    rho: float = param(0.05, "> 0")
    dual_mean: Literal["participants", "all"] = param("participants", "participants|all", before="participants")


def build(p: FedSpeedParams, run: Mapping[str, Any]) -> Algorithm:
    step = FedSpeedStep(p.lambda_, p.alpha, p.rho, upload_dual=p.dual_mean == "participants")
    phases = [Phase("gm", step=step)]
    if p.dual_mean == "participants":
        return Algorithm("fedspeed", phases=phases)
    return Algorithm("fedspeed", phases=phases, server=FedDynUpdate(1 / p.lambda_, training_clients(run)))


register("fedspeed", FedSpeedParams, build)

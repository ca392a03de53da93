"""pFedMe (Dinh, Tran and Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020), as its Algorithm 1 and the authors' code (github.com/CharlieDinh/pFedMe:
``userpFedMe.py``, ``pFedMeOptimizer``) train it.

Client ``i`` keeps a local model ``w_i`` and a personal model ``theta_i`` (the PM); both start
each round from the received global ``w``, as in the authors' code (``set_parameters`` copies the
global model into the personal and the local model). For each batch ``D_b`` of the local round:

    theta_i ~= argmin_theta f_i(theta; D_b) + (lambda/2) ||theta - w_i||^2     (K plain gradient
               steps theta <- theta - personal_lr * (grad f_i(theta; D_b) + lambda (theta - w_i))
               from the current theta_i, as the authors' optimizer)
    w_i <- w_i - eta * lambda * (w_i - theta_i)

``eta`` is the run's learning rate (``lr``). Both steps are the paper's plain steps, taken by hand
as the authors' code takes them: the run's momentum, weight decay or Adam moments apply to
neither. Departure from the authors' code: their ``pFedMeOptimizer`` adds ``mu * theta`` to the
inner gradient (``mu`` = 0.001 by default); the paper has no such term and neither has wafl.

The client uploads ``w_i``; the server takes ``w <- (1 - beta) w + beta * mean_i w_i`` (sample
weights, the authors' code; the paper's Algorithm 1 divides by ``S``, a uniform mean).

The personalized model is ``theta_i`` as the last batch's inner solve left it (the paper's
``theta_i(w_i)``; the authors' ``persionalized_model_bar``): it is evaluated as is, after the
next broadcast (before the next round touches it). No personal phase follows the local round,
under either protocol: the paper trains ``theta_i`` only inside the local round, so ``pm_epochs``
and the wait-free PM time train nothing for pFedMe (its personal phase has zero steps). The phase
wafl ran there before (one epoch re-solving the inner problem towards the uploaded ``w_i`` with the
run's optimizer, SGD lr 0.03 momentum 0.5 in the SCD Fashion-MNIST table) is not pFedMe's, and
anchored at ``lambda`` = 15 to ``w_i`` it oscillated on some clients instead of converging (one
client's theta went from 93 % to 43 % on its local test split in one epoch; at 10 clients theta
after the local round scored 79, 83, 80, 84 % in rounds 1-4 and the PM after that phase 60, 45,
42, 34 %): the table's PM fell from 63 % to 45 % over 15 rounds. Note on the
authors' code: its ``persionalized_model_bar`` is the list of the personal model's own parameters,
which ``update_parameters(self.local_model)`` overwrites at the end of ``train``, so the code as
published scores ``w_i`` after the local round; wafl scores the paper's ``theta_i``.

An unselected client does not train (the authors' code trains every client and aggregates the
selected ones). A new client (``new_clients``; the paper has none) adapts a received global model
as a local round does: ``new_client_epochs`` epochs of the inner solves and outer steps from ``w``, then
its theta is tested (``Algorithm.pm_by_local_round``). Defaults: ``lambda`` 15, ``personal_lr`` 0.01,
``K`` 5, ``beta`` 1 (the authors' README: ``lambda`` 15 with ``personal_lr`` 0.1 or 0.09 on MNIST,
``lambda`` 20 with ``personal_lr`` 0.01 on Synthetic; ``K`` 5, ``beta`` 1, ``eta`` 0.005).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.algorithms.base import (
    Algorithm,
    AlgorithmStateError,
    Phase,
    RoundContext,
    ServerUpdate,
    StepContext,
    StepRule,
)
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
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
        eta = float(ctx.optimizer.param_groups[0]["lr"])  # the run's lr; the paper's plain outer step
        with torch.no_grad():
            for w, t in zip(ctx.params, theta):
                w.sub_(eta * self.lam * (w - t))
        return loss.detach()


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


@dataclass(frozen=True)
class PFedMeParams:
    lambda_: float = param(15.0, "> 0", name="lambda")
    personal_lr: float = param(0.01, "> 0")
    k: int = param(5, "int >= 1")
    beta: float = param(1.0, "> 0")


def build(p: PFedMeParams, run: Mapping[str, Any]) -> Algorithm:
    return Algorithm(
        "pfedme",
        phases=[Phase("gm", step=MoreauStep(p.lambda_, p.personal_lr, p.k))],
        server=PFedMeServer(p.beta),
        personal="separate",
        # the PM is theta as the local round left it: no personal phase trains it further (zero steps)
        pm_phase=Phase("pm", steps=0, main=False),
        pm_by_local_round=True,  # a new client's theta: the local round's inner solves (Trainer.adapt)
    )


register("pfedme", PFedMeParams, build)

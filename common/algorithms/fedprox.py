"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020): cross-entropy plus ``(mu/2) ||w - w_global||^2``; the term
also serves Ditto's PM."""

from __future__ import annotations

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, Forward, LossTerm, RoundContext
from wafl.common.algorithms.registry import Param, register
from wafl.common.algorithms.regularizers import proximal_term


class Proximal(LossTerm):
    """``(mu/2) ||w - w_g||^2`` towards the received global model."""

    name = "proximal"

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return proximal_term(model, ctx.global_params, self.mu)


register("fedprox", {"mu": Param(0.01, "> 0")}, lambda p, run: Algorithm("fedprox", p, gm_terms=[Proximal(p["mu"])]))

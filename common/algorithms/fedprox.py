"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020): cross-entropy plus ``(mu/2) ||w - w_global||^2``; the term
also serves Ditto's PM."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, Forward, LossTerm, RoundContext
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.regularizers import proximal_term


class Proximal(LossTerm):
    """``(mu/2) ||w - w_g||^2`` towards the received global model."""

    name = "proximal"

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return proximal_term(model, ctx.global_params, self.mu)


@dataclass(frozen=True)
class FedProxParams:
    mu: float = param(0.01, "> 0")


register("fedprox", FedProxParams, lambda p, run: Algorithm("fedprox", gm_terms=[Proximal(p.mu)]))

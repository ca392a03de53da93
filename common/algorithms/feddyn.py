"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough and Saligrama, "Federated Learning Based on
Dynamic Regularization", ICLR 2021): ``CE - <w, g_k> + (alpha/2) ||w - w_g||^2`` with client state ``g_k`` (kept across
rounds and restarts) and the server state ``h`` (``server_updates.FedDynUpdate``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, Forward, LossTerm, RoundContext
from wafl.common.algorithms.registry import Param, register
from wafl.common.algorithms.regularizers import feddyn_client_state_update, feddyn_term
from wafl.common.algorithms.server_updates import FedDynUpdate

STATE_KEY = "feddyn_grad"


class DynamicRegularizer(LossTerm):
    name = "feddyn"

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.grad: list[torch.Tensor] = []

    def begin(self, ctx: RoundContext, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        saved = ctx.client_state.get(STATE_KEY)
        self.grad = (
            [g.to(p.device) for g, p in zip(saved, params)]
            if saved is not None
            else [torch.zeros_like(p) for p in params]
        )

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return feddyn_term(model, ctx.global_params, self.grad, self.alpha)

    def end(self, ctx: RoundContext, model: nn.Module) -> None:
        local = [p.detach() for p in model.parameters() if p.requires_grad]
        ctx.client_state[STATE_KEY] = [
            g.cpu() for g in feddyn_client_state_update(self.grad, local, ctx.global_params, self.alpha)
        ]


def build(p: dict[str, Any], run: Mapping[str, Any]) -> Algorithm:
    return Algorithm(
        "feddyn",
        p,
        gm_terms=[DynamicRegularizer(p["alpha"])],
        server=FedDynUpdate(p["alpha"], int(run.get("num_clients", 1))),
    )


register("feddyn", {"alpha": Param(0.01, "> 0")}, build)

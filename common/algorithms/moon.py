"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021).

With ``z = R(x)`` the local model's representation, ``z_glob`` the received global model's and
``z_prev`` the client's own model from the end of its previous round (both frozen),

    L = CE + mu * (1/B) sum_b -log( e^{s_glob,b} / (e^{s_glob,b} + e^{s_prev,b}) ),
    s_glob,b = cos(z_b, z_glob,b) / tau,  s_prev,b = cos(z_b, z_prev,b) / tau

``tau`` 0.5; ``mu`` 1 (the paper's CIFAR-100 value; 5 for CIFAR-10). ``R`` is wafl's
feature extractor, which ends in the ``code_len`` projection (MOON's projection head). Before
a client's first round its previous model is the received global model (the authors' code
starts every client's previous model from the initial one). The previous model is client state:
it persists across rounds and restarts. The server is FedAvg.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.algorithms.base import Algorithm, AlgorithmStateError, Forward, LossTerm, RoundContext
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.models.base import SplitModel

STATE_KEY = "moon_previous_model"


def moon_term(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """The contrastive loss above, a mean over the batch (without ``mu``)."""
    z, z_glob, z_prev = z.flatten(1), z_glob.flatten(1), z_prev.flatten(1)
    pos = F.cosine_similarity(z, z_glob, dim=-1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=-1) / tau
    logits = torch.stack([pos, neg], dim=1)
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.int64, device=z.device))


class ModelContrast(LossTerm):
    name = "moon"

    def __init__(self, mu: float, tau: float) -> None:
        self.mu, self.tau = mu, tau
        self.previous: SplitModel | None = None

    def begin(self, ctx: RoundContext, model: nn.Module) -> None:
        prev = copy.deepcopy(ctx.teacher)  # frozen, eval mode; the received global model until a round is done
        saved = ctx.client_state.get(STATE_KEY)
        if saved is not None:
            prev.load_state_dict({k: v.to(next(prev.parameters()).device) for k, v in saved.items()})
        self.previous = prev

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        if self.previous is None:
            raise AlgorithmStateError("moon: the contrastive term ran before its phase began (no previous model)")
        with torch.no_grad():
            z_glob = ctx.teacher.features(out.x)
            z_prev = self.previous.features(out.x)
        return self.mu * moon_term(out.h, z_glob, z_prev, self.tau)

    def end(self, ctx: RoundContext, model: nn.Module) -> None:
        ctx.client_state[STATE_KEY] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        self.previous = None


@dataclass(frozen=True)
class MoonParams:
    mu: float = param(1.0, ">= 0")
    tau: float = param(0.5, "> 0")


def build(p: MoonParams, run: Mapping[str, Any]) -> Algorithm:
    return Algorithm("moon", gm_terms=[ModelContrast(p.mu, p.tau)])


register("moon", MoonParams, build)

"""FedHKD (Chen, Wang and Vikalo, "The Best of Both Worlds: Accurate Global and Personalized
Models through Federated Learning with Data-Free Hyper-Knowledge Distillation", ICLR 2023):
hyper-knowledge (class-mean representations and soft predictions, Gaussian DP noise
on the representations) shared with the model; the loss pulls the classifier and the features
towards the global knowledge. ``gamma = 0`` is FedHKD*. The personalized model is the local
model right after local training.

``knowledge_clip`` (1.1 by default, 0: off): in the rounds that train with global knowledge (the second on),
each step's gradient is clipped to this L2 norm before the optimizer steps, as the authors' code does
(``ClientFedHKD.update_weights_HKD``, a fixed ``clip_grad_norm_(..., max_norm=1.1)``; the paper does not
mention it). The first round, without knowledge, is not clipped there either."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, Forward, LossTerm, Phase, RoundContext, clipped_with_knowledge
from wafl.common.algorithms.hyperknowledge import extract_knowledge, fedhkd_loss_terms
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.knowledge import Knowledge
from wafl.common.models.base import SplitModel, submodule
from wafl.common.privacy import privacy_report


class HyperKnowledgeLoss(LossTerm):
    name = "fedhkd"

    def __init__(self, lam: float, gamma: float, temperature: float) -> None:
        self.lam, self.gamma, self.temperature = lam, gamma, temperature

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        t1, t2 = fedhkd_loss_terms(out.h, out.y, submodule(model, "classifier"), ctx.knowledge, self.temperature)
        return self.lam * t1 + self.gamma * t2


@dataclasses.dataclass(frozen=True)
class FedHKDParams:
    lambda_: float = param(0.05, ">= 0", name="lambda")
    gamma: float = param(0.05, ">= 0")
    temperature: float = param(0.5, "> 0")
    nu: float = param(0.25, "[0, 1)")
    zeta: float = param(3.0, "> 0")
    sigma: float = param(7.0, ">= 0")
    delta: float = param(1e-5, "(0, 1)")
    knowledge_clip: float = param(1.1, ">= 0")  # the authors' code's clip in the rounds with knowledge; 0: off


def build(p: FedHKDParams, run: Mapping[str, Any]) -> Algorithm:
    def knowledge(
        model: SplitModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], ctx: RoundContext, gen: torch.Generator
    ) -> Knowledge:
        return extract_knowledge(model, batches, ctx.label_freq.numel(), p.nu, p.zeta, p.sigma, p.temperature, gen)

    def privacy(releases: int) -> dict[str, Any]:
        if p.sigma == 0:
            return {
                "sigma": 0.0,
                "delta": p.delta,
                "zeta": p.zeta,
                "releases": releases,
                "epsilon_per_release": None,
                "epsilon_per_run": None,
                "composition": "none: sigma = 0 adds no noise, epsilon is unbounded",
            }
        return dataclasses.asdict(privacy_report(p.sigma, p.delta, p.zeta, releases))

    terms: list[LossTerm] = [HyperKnowledgeLoss(p.lambda_, p.gamma, p.temperature)]
    return Algorithm(
        "fedhkd",
        gm_terms=terms,
        phases=[Phase("gm", terms=terms, step=clipped_with_knowledge(p.knowledge_clip))],
        knowledge=knowledge,
        local_model_is_personal=True,
        privacy=privacy,
    )


register("fedhkd", FedHKDParams, build)

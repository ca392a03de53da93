"""FedNTD (Lee, Jeong, Shin, Bae and Yun, "Preservation of the Global Knowledge by Not-True
Distillation in Federated Learning", NeurIPS 2022): cross-entropy plus ``beta * KL`` on the not-true
classes, teacher = received global model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, Forward, LossTerm, RoundContext
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.regularizers import ntd_term


class NotTrueDistillation(LossTerm):
    name = "ntd"

    def __init__(self, beta: float, temperature: float) -> None:
        self.beta, self.temperature = beta, temperature

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return self.beta * ntd_term(out.logits, out.teacher_logits, out.y, self.temperature)


@dataclass(frozen=True)
class FedNTDParams:
    ntd_beta: float = param(1.0, ">= 0")
    ntd_temperature: float = param(1.0, "> 0")


register(
    "fedntd",
    FedNTDParams,
    lambda p, run: Algorithm("fedntd", gm_terms=[NotTrueDistillation(p.ntd_beta, p.ntd_temperature)]),
)

"""Adaptive self-distillation (ASD), a regularizer for any base method: ``fedavg+asd``, ``feddyn+asd``...

Yashwanth, Nayak, Singh, Simmhan and Chakraborty, "Adaptive Self-Distillation for Minimizing
Client Drift in Heterogeneous Federated Learning", TMLR 2024.

``lambda * sum_i alpha_i KL(q_global,i || q_local,i)`` at temperature T, with sample weights
``alpha_i`` from the teacher's entropy and the client's label frequencies (``asd_uniform``:
``alpha_i = 1/B``). The teacher is a frozen eval-mode copy of the received global model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from wafl.common.algorithms.base import Forward, LossTerm, RoundContext
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register_regularizer
from wafl.common.algorithms.regularizers import asd_term


class AdaptiveSelfDistillation(LossTerm):
    name = "asd"

    def __init__(self, weight: float, temperature: float, uniform: bool) -> None:
        self.weight, self.temperature, self.uniform = weight, temperature, uniform

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return self.weight * asd_term(
            out.logits, out.teacher_logits, out.y, ctx.label_freq, self.temperature, self.uniform
        )


@dataclass(frozen=True)
class ASDParams:
    asd_lambda: float = param(2.0, ">= 0")
    asd_temperature: float = param(2.0, "> 0")
    asd_uniform: bool = param(False, "bool")


def build(p: ASDParams) -> list[LossTerm]:
    if p.asd_lambda == 0:
        return []  # exactly the base method
    return [AdaptiveSelfDistillation(p.asd_lambda, p.asd_temperature, p.asd_uniform)]


register_regularizer("asd", ASDParams, build)

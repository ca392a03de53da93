"""FedProto: class prototypes (mean representations) shared on the knowledge channel; the local
loss is ``CE + lambda * MSE(h, prototype_y)``; accuracy is the local model's."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, Forward, LossTerm, RoundContext
from wafl.common.algorithms.prototypes import extract_prototypes, fedproto_term
from wafl.common.algorithms.registry import Param, register
from wafl.common.knowledge import Knowledge
from wafl.common.models.base import SplitModel


class PrototypeLoss(LossTerm):
    name = "fedproto"

    def __init__(self, lam: float) -> None:
        self.lam = lam

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return self.lam * fedproto_term(out.h, out.y, ctx.knowledge)


def _prototypes(
    model: SplitModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], ctx: RoundContext, gen: torch.Generator
) -> Knowledge:
    return extract_prototypes(model, batches, ctx.label_freq.numel())


register(
    "fedproto",
    {"proto_lambda": Param(1.0, ">= 0")},
    lambda p, run: Algorithm(
        "fedproto", p, gm_terms=[PrototypeLoss(p["proto_lambda"])], knowledge=_prototypes, local_model_is_personal=True
    ),
)

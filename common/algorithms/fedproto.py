"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang and Zhang, "FedProto: Federated Prototype Learning
across Heterogeneous Clients", AAAI 2022), as in its paper, and the variant FedHKD's paper reports.

``fedproto`` (the paper): clients exchange class prototypes only, never model weights. Client
``i`` trains its own model on ``CE + lambda * (1/(B d)) sum_b ||h_b - C^{y_b}||^2`` (the mean
squared distance over every sample of the batch and every dimension; a sample whose class has
no global prototype yet contributes 0, as in the authors' code), then sends its prototypes
``C_i^j = mean_{x in D_i^j} f_i(x)`` (eval mode, after local training) with their counts
``|D_i^j|``. The server averages each class's prototypes over the clients ``N_j`` that hold the
class, as ``proto_weighting`` says:

* ``"count"`` (the default; the paper's aggregation): weighted by each client's number of
  samples of the class, ``C^j = sum_{i in N_j} |D_i^j| C_i^j / sum_{i in N_j} |D_i^j|``;
* ``"uniform"`` (what the authors' code does, and wafl's ``fedproto`` before the parameter
  existed): the unweighted mean, ``C^j = (1/|N_j|) sum_{i in N_j} C_i^j``.

There is no global model (``gm_accuracy`` is null); the personal model is the local model right
after local training, tested on the local test set. The local model and the prototypes are the
only state, both persisted by the client.

``fedproto-avg`` (FedProto as FedHKD's paper runs it): the same client loss averaged over the
samples that have a prototype, the prototypes averaged as ``proto_weighting`` says (the same
choice and default; its count-weighted average is what it always did), and a FedAvg global model
besides. ``knowledge_clip`` (1.1 by default, 0: off): as FedHKD's (:mod:`~wafl.common.algorithms.fedhkd`),
the gradient clip that FedHKD's code applies to FedProto's steps in the rounds with global prototypes
(``ClientFedProto.update_weights_Proto``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from wafl.common.algorithms.base import (
    NOTHING,
    Algorithm,
    Forward,
    LossTerm,
    Phase,
    RoundContext,
    clipped_with_knowledge,
)
from wafl.common.algorithms.params import param
from wafl.common.algorithms.prototypes import extract_prototypes, fedproto_paper_term, fedproto_term
from wafl.common.algorithms.registry import register
from wafl.common.knowledge import Knowledge
from wafl.common.models.base import SplitModel


class PrototypeLoss(LossTerm):
    name = "fedproto"

    def __init__(self, lam: float, over_all_samples: bool) -> None:
        self.lam, self.over_all_samples = lam, over_all_samples

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        term = fedproto_paper_term if self.over_all_samples else fedproto_term
        return self.lam * term(out.h, out.y, ctx.knowledge)


def _prototypes(
    model: SplitModel, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], ctx: RoundContext, gen: torch.Generator
) -> Knowledge:
    return extract_prototypes(model, batches, ctx.label_freq.numel())


@dataclass(frozen=True)
class FedProtoParams:
    proto_lambda: float = param(1.0, ">= 0")
    proto_weighting: Literal["count", "uniform"] = param("count", "count|uniform")  # the server's per-class average


register(
    "fedproto",
    FedProtoParams,
    lambda p, run: Algorithm(
        "fedproto",
        gm_terms=[PrototypeLoss(p.proto_lambda, over_all_samples=True)],
        knowledge=_prototypes,
        knowledge_weighting=p.proto_weighting,
        shares=NOTHING,
        evaluates_global=False,
        local_model_is_personal=True,
    ),
)


@dataclass(frozen=True)
class FedProtoAvgParams(FedProtoParams):
    knowledge_clip: float = param(1.1, ">= 0")  # FedHKD's code's clip in the rounds with prototypes; 0: off


def _fedproto_avg(p: FedProtoAvgParams, run: Mapping[str, Any]) -> Algorithm:
    terms: list[LossTerm] = [PrototypeLoss(p.proto_lambda, over_all_samples=False)]
    return Algorithm(
        "fedproto-avg",
        gm_terms=terms,
        phases=[Phase("gm", terms=terms, step=clipped_with_knowledge(p.knowledge_clip))],
        knowledge=_prototypes,
        knowledge_weighting=p.proto_weighting,
        local_model_is_personal=True,
    )


register("fedproto-avg", FedProtoAvgParams, _fedproto_avg)

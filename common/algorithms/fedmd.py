"""FedMD (Li and Wang, "FedMD: Heterogenous Federated Learning via Model Distillation", NeurIPS 2019
Workshop on Federated Learning for Data Privacy and Confidentiality, arXiv:1910.03581): federated
model distillation on a public data set.

Every client keeps its own model; no weights travel. A public split of ``public_size``
samples (drawn from the train split by the seed, stratified, removed from every client's
partition; its labels are never used) is known to all. A round, for client ``i``:

* digest (from the second round): train on the public split towards the consensus scores,
  ``min (1/(P C)) sum_{x in public} || s_i(x) - S(x) ||_1`` for ``digest_epochs`` epochs, where
  ``s_i`` are the model's logits (the authors' code removes the softmax and fits the consensus
  with the mean absolute error);
* revisit: train on the private shard with cross-entropy for ``local_epochs``;
* communicate: upload its scores ``s_i(x)`` (logits, eval mode) on the whole public split.

The server averages the scores uniformly over the round's clients, ``S = (1/|S_t|) sum_i s_i``,
and sends the consensus with the next round. The authors' code draws a fresh alignment subset of
the public data each round and starts with transfer learning on the labelled public set; here
the whole (small) public split aligns every round and there is no labelled pre-training. There
is no global model (``gm_accuracy`` is null); the personal model is the local model right after
the round's training, tested on the local test set. The model persists across restarts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from wafl.common.algorithms.base import (
    NOTHING,
    Algorithm,
    ClientHooks,
    Forward,
    LossTerm,
    Phase,
    RoundContext,
    ServerUpdate,
)
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.models.base import SplitModel

SCORES = "consensus"


def digest_loss(logits: torch.Tensor, consensus: torch.Tensor) -> torch.Tensor:
    """Mean absolute error between the model's logits and the consensus scores."""
    return (logits - consensus.to(logits.dtype)).abs().mean()


class Digest(LossTerm):
    name = "fedmd_digest"

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return digest_loss(out.logits, ctx.extras[SCORES][out.y])  # y: positions in the public split


@torch.no_grad()
def public_scores(model: nn.Module, ctx: RoundContext) -> torch.Tensor:
    """The model's logits on the whole public split, in its order, eval mode (mode restored)."""
    was = model.training
    model.eval()
    parts = [(pos, model(x)) for x, pos in ctx.public()]
    model.train(was)
    out = torch.empty(sum(len(p) for p, _ in parts), parts[0][1].shape[1], device=parts[0][1].device)
    for pos, s in parts:
        out[pos] = s
    return out


class Hooks(ClientHooks):
    def upload(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        return {SCORES: public_scores(ctx.gm, ctx)}


class Consensus(ServerUpdate):
    """The uniform mean of the clients' scores (a round's, so not under buffered aggregation)."""

    buffered_ok = False

    def weight(self, num_samples: int, metrics: Mapping[str, float] | None = None) -> float:
        return 1.0

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        return mean


@dataclass(frozen=True)
class FedMDParams:
    public_size: int = param(200, "int >= 1")
    digest_epochs: float = param(1.0, "> 0")


def build(p: FedMDParams, run: Mapping[str, Any]) -> Algorithm:
    size = p.public_size

    def scores(model: SplitModel) -> dict[str, torch.Tensor]:
        return {SCORES: torch.zeros(size, model.num_classes)}

    return Algorithm(
        "fedmd",
        phases=[
            Phase(
                "digest",
                terms=[Digest()],
                data="public",
                cross_entropy=False,
                epochs=p.digest_epochs,
                main=False,
                when=lambda ctx: ctx.round > 1,
            ),
            Phase("revisit"),
        ],
        shares=NOTHING,
        extras=scores,
        hooks=Hooks(),
        server=Consensus(),
        public_size=size,
        evaluates_global=False,
        local_model_is_personal=True,
    )


register("fedmd", FedMDParams, build)

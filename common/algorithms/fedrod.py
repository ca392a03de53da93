"""FedRoD (Chen and Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022): one body, a generic head and a personal head.

The local model is the body ``f`` and the generic head ``g`` (both shared and averaged by sample
count) plus a personal head ``p_i`` (zero at the start, never sent). On a batch, with
``h = f(x)``, client ``i`` minimises

    L = CE(g(h) + log n_i, y) + CE(g(h).detach() + p_i(h.detach()), y)

where ``n_i`` are the client's per-class train counts: the first term is the balanced softmax
(the paper's balanced risk; a class the client lacks has ``log 0 = -inf`` and so no
probability), which trains the body and the generic head; the second trains only the personal
head, on detached features, to correct the generic prediction (the authors' code, without the
hypernetwork). The generic model is ``g(f(x))`` (tested on the global test set); the
personal model predicts ``g(f(x)) + p_i(f(x))``. The personal phase trains ``p_i`` alone (the
second term), wait-free until the next broadcast or ``pm_epochs`` under compute-and-wait, also
for a client that was not selected. ``p_i`` persists across restarts.

Evaluation: the PM of round ``t`` is the client's own model at the end of its round, ``f_i`` and
``g_i`` as its local training left them with ``p_i`` as its personal phase left it, tested on the
local test split when the next broadcast arrives and before it is loaded (not the received
``f, g``: unlike FedRep, ``pm_on_received`` is off). This is the paper's P-FL protocol as we read
it: personalized models are tested after local training (the paper reports FedAvg's local models
after local training as its P-FL baseline the same way). The authors' repository
(hongyouc/Fed-RoD) publishes no code, so no released evaluation script confirms the step.
Departure: ``p_i`` has also trained in wafl's personal phase (wait-free: until the next
broadcast) after the round's local epochs. The final PM is the model of the last round, tested
when the final model arrives (the final ``f, g`` are not loaded into it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.algorithms.base import Algorithm, Forward, LossTerm, Phase, RoundContext
from wafl.common.algorithms.params import NoParams
from wafl.common.algorithms.registry import register
from wafl.common.models.base import SplitModel, submodule

PERSONAL = "personal_head"


def with_personal_head(model: SplitModel) -> SplitModel:
    """Adds the personal head (zeros: the personal model starts as the generic one)."""
    head = nn.Linear(model.code_len, model.num_classes)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model.add_module(PERSONAL, head)
    return model


def personal_logits(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``g(h).detach() + p(h.detach())``: the personal prediction, whose gradient reaches ``p`` only."""
    return submodule(model, "classifier")(h).detach() + getattr(model, PERSONAL)(h.detach())


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``CE(logits + log counts, y)``."""
    return F.cross_entropy(logits + torch.log(counts.to(logits.dtype)).unsqueeze(0), y)


class BalancedSoftmax(LossTerm):
    name = "balanced_softmax"

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return balanced_softmax_loss(out.logits, out.y, ctx.label_freq)  # frequencies: same softmax as counts


class PersonalHeadLoss(LossTerm):
    name = "personal_head"

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        return F.cross_entropy(personal_logits(model, out.h), out.y)


class PersonalView(nn.Module):
    """The personal model: ``g(f(x)) + p(f(x))``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = submodule(self.model, "features")(x)
        return submodule(self.model, "classifier")(h) + getattr(self.model, PERSONAL)(h)


def build(p: NoParams, run: Mapping[str, Any]) -> Algorithm:
    personal_only = lambda m: list(getattr(m, PERSONAL).parameters())  # noqa: E731
    return Algorithm(
        "fedrod",
        phases=[Phase("gm", terms=[BalancedSoftmax(), PersonalHeadLoss()], cross_entropy=False)],
        wrap=with_personal_head,
        shares=lambda k: not k.startswith(PERSONAL + "."),
        personal="local",
        pm_phase=Phase("pm", terms=[PersonalHeadLoss()], params=personal_only, cross_entropy=False, main=False),
        pm_view=PersonalView,
        pm_when_unselected=True,
    )


register("fedrod", NoParams, build)

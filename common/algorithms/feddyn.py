"""FedDyn (Acar, Zhao, Matas, Mattina, Whatmough and Saligrama, "Federated Learning Based on
Dynamic Regularization", ICLR 2021): dynamic regularization, all of it in this file.

The client ``k`` keeps ``g_k`` (zero at first; client state, kept across rounds and restarts) and
trains on

    CE - <w, g_k> + (alpha/2) ||w - w_g||^2                      (w_g: the received global model)

(:func:`feddyn_term`, the loss term :class:`DynamicRegularizer`); after local training
``g_k <- g_k - alpha (w_k - w_g)`` (:func:`feddyn_client_state_update`). The server
(:class:`FedDynUpdate`) takes the uniform mean over the round's participants ``S`` and keeps ``h``
(zero at first, checkpointed):

    h   <- h - alpha (1/m) sum_S (w_k - w_g)                     (m = all training clients)
    w_g <- mean_S(w_k) - h / alpha

(:func:`feddyn_server_update`, on every trained floating tensor; normalization statistics are
averaged). ``scored_model`` is the model the server evaluates: ``"global"`` (the default) the ``w_g`` it
broadcasts, ``"participants"`` the round's uniform mean ``mean_S(w_k)`` before ``h`` corrects it, the model
FedDyn's code and ASD's score (``avg_model``, "Communication sel"; the paper's analysis bounds that average's
risk too). ``m`` is the paper's number of clients: with ``new_clients = K`` held out of training it
is ``num_clients - K`` (:func:`~wafl.common.algorithms.server_updates.training_clients`), the
clients whose ``g_k`` the server's ``h`` tracks (a held-out client never uploads). ``alpha`` 0.01.
The term joins the phase like any loss term, so a composed regularizer (``feddyn+asd``) adds its
own term next to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from wafl.common.algorithms.base import Algorithm, Forward, LossTerm, RoundContext, ServerUpdate
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.regularizers import aligned
from wafl.common.algorithms.server_updates import is_weight, training_clients

STATE_KEY = "feddyn_grad"


def feddyn_term(model: nn.Module, anchor: Sequence[Tensor], grad_state: Sequence[Tensor], alpha: float) -> Tensor:
    """FedDyn's client term ``-<w, g_k> + (alpha/2) ||w - w_g||^2``.

    ``anchor`` is the received global model ``w_g``, ``grad_state`` the client's state ``g_k``, both
    aligned with the model's trainable parameters (see :func:`~wafl.common.algorithms.regularizers.aligned`).
    """
    pairs = aligned(model, anchor, "anchor")
    states = aligned(model, grad_state, "grad_state")
    # Tensors, not the start value 0: aligned raises when the model has no trainable parameters.
    linear = cast(Tensor, sum((p * g).sum() for p, g in states))
    quad = cast(Tensor, sum(((p - a) ** 2).sum() for p, a in pairs))
    return -linear + 0.5 * alpha * quad


@torch.no_grad()
def feddyn_client_state_update(
    grad_state: Sequence[Tensor], local: Sequence[Tensor], anchor: Sequence[Tensor], alpha: float
) -> list[Tensor]:
    """The client state after local training: ``g_k <- g_k - alpha (w_k - w_g)`` (new tensors)."""
    if not (len(grad_state) == len(local) == len(anchor)):
        raise ValueError(f"length mismatch: grad_state {len(grad_state)}, local {len(local)}, anchor {len(anchor)}")
    return [g - alpha * (w.detach() - a.detach()) for g, w, a in zip(grad_state, local, anchor)]


@torch.no_grad()
def feddyn_server_update(
    global_w: Tensor, sum_local_w: Tensor, num_participants: int, h: Tensor, alpha: float, num_clients: int
) -> tuple[Tensor, Tensor]:
    """FedDyn server step on one tensor.

    ``h <- h - alpha (1/m) sum_S (w_k - w_g)`` with ``m = num_clients`` (all training clients), then
    ``w_g <- mean_S(w_k) - h / alpha`` with the updated ``h``. ``sum_local_w`` is ``sum_S w_k``
    over the ``num_participants`` clients of this round. Returns ``(new_global, new_h)``.
    """
    if num_participants < 1:
        raise ValueError(f"num_participants must be >= 1, got {num_participants}")
    if num_clients < num_participants:
        raise ValueError(f"num_clients ({num_clients}) < num_participants ({num_participants})")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    drift = sum_local_w - num_participants * global_w
    new_h = h - (alpha / num_clients) * drift
    new_global = sum_local_w / num_participants - new_h / alpha
    return new_global, new_h


class DynamicRegularizer(LossTerm):
    """The client side: :func:`feddyn_term` on every batch, ``g_k`` read at the phase's start and
    updated at its end."""

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


class FedDynUpdate(ServerUpdate):
    """The server side: uniform mean over participants, ``h <- h - alpha/m sum(w_k - w)``, ``w <- mean - h/alpha``."""

    buffered_ok = False

    def __init__(self, alpha: float, num_clients: int, score_participants: bool = False) -> None:
        self.alpha, self.num_clients = alpha, num_clients
        self.score_participants = score_participants  # evaluate mean_S(w_k), not the corrected w_g
        self.h: dict[str, torch.Tensor] = {}
        self._mean: dict[str, torch.Tensor] | None = None

    def weight(self, num_samples: int, metrics: Mapping[str, float] | None = None) -> float:
        return 1.0

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        out = dict(mean)
        for k, w in prev.items():
            if is_weight(k, w):
                h = self.h.get(k, torch.zeros_like(w))
                out[k], self.h[k] = feddyn_server_update(
                    w, mean[k].to(w.dtype) * participants, participants, h, self.alpha, self.num_clients
                )
        if self.score_participants:
            self._mean = {k: mean[k].to(w.dtype) if is_weight(k, w) else out[k] for k, w in out.items()}
        return out

    def scored(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return self._mean if self.score_participants and self._mean is not None else state

    def state_dict(self) -> dict[str, Any]:
        return {"h": self.h}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.h = dict(state.get("h", {}))


@dataclass(frozen=True)
class FedDynParams:
    alpha: float = param(0.01, "> 0")
    scored_model: Literal["global", "participants"] = param("global", "global|participants", before="global")


def build(p: FedDynParams, run: Mapping[str, Any]) -> Algorithm:
    return Algorithm(
        "feddyn",
        gm_terms=[DynamicRegularizer(p.alpha)],
        server=FedDynUpdate(p.alpha, training_clients(run), p.scored_model == "participants"),
    )


register("feddyn", FedDynParams, build)

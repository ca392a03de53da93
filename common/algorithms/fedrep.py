"""FedRep (Collins, Hassani, Mokhtari and Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021): a shared representation, personal heads.

Client ``i`` holds the global body ``phi`` and its own head ``h_i``. In a round it first trains
the head with the body frozen, ``h_i <- argmin_h f_i(phi, h)`` by SGD for ``tau_h`` epochs, then
the body with the head frozen, ``phi_i <- phi - eta grad_phi f_i(phi, h_i)`` for ``tau_phi``
epochs; only the body travels and the server averages it, ``phi <- sum_i p_i phi_i`` (sample
weights, as FedAvg). Following the authors' code, the round's local epochs are split: the
body trains for ``rep_epochs`` (their ``local_rep_ep``, 1) and the head for the rest of
``local_epochs`` (at least one).

The personal model is the global body with the personal head, ``(phi, h_i)``. Its personal phase
trains the head alone on the body it holds: wait-free until the next broadcast, ``pm_epochs``
under compute-and-wait, and also for a client that was not selected (its head adapts to the body
it received). The head never travels and persists across restarts; there is no meaningful global
model to test (``gm_accuracy`` is null).

Evaluation (``pm_on_received``): the PM of round ``t`` is scored as the paper's and the authors'
code do (``main_fedrep.py``: the averaged body is loaded into every client's net, then
``test_img_local_all`` with each client's own head), i.e. the *received* global body
``phi^{t+1}`` with the head ``h_i`` as it stands when that body arrives, on the local test split;
never the client's own locally trained body ``phi_i``. The final PM is the final global body with
the head of the last round. Departures: ``h_i`` is the head after wafl's personal phase, which
trains it on the client's own body ``phi_i`` of the round (the authors' head epochs run on the
received body, before the body epochs); and the authors' last round, where every client
fine-tunes its head for ``max(10, local_ep - local_rep_ep)`` epochs on the last body and the
body is not averaged again, has no counterpart (wafl's final PM uses the final averaged body).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wafl.common.algorithms.base import BODY, Algorithm, Phase
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register


@dataclass(frozen=True)
class FedRepParams:
    rep_epochs: float = param(1.0, "> 0")


def build(p: FedRepParams, run: Mapping[str, Any]) -> Algorithm:
    body_epochs = p.rep_epochs
    head_epochs = max(1.0, float(run.get("local_epochs", 2)) - body_epochs)
    return Algorithm(
        "fedrep",
        phases=[
            Phase("head", params="head", epochs=head_epochs, main=False),
            Phase("body", params="body", epochs=body_epochs),
        ],
        shares=BODY,
        evaluates_global=False,
        personal="local",
        pm_phase=Phase("pm", params="head", main=False),
        pm_when_unselected=True,
        pm_on_received=True,
    )


register("fedrep", FedRepParams, build)

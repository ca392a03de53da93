"""FedBABU (Oh, Kim and Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022): train and average the body only, the head frozen at its initialisation.

During federated training every client's head stays at the common random initialisation
``h_0`` (never updated, never sent: every process builds it from the seed); a client trains the
body ``phi_i <- phi - eta grad_phi f_i(phi, h_0)`` for ``local_epochs`` and the server averages
the bodies, ``phi <- sum_i p_i phi_i``. The global model is ``(phi, h_0)`` and is tested as is.

Personalisation is fine-tuning: the personal model restarts from each received global model and
is fine-tuned on the local data (the whole network by default, as the paper's main results;
``finetune = head`` fine-tunes the head only), wait-free until the next broadcast or for
``pm_epochs`` under compute-and-wait, with a fresh optimizer each time. Any client fine-tunes
the model it received, selected or not.

Evaluation: the PM of round ``t`` is the global model received at the start of round ``t``
fine-tuned in the round's personal phase, tested on the local test split when the next broadcast
arrives (before the PM restarts from it). The paper fine-tunes the *final* global model for
``tau_f`` epochs and tests that; during training (``main_fed.py`` of the code, read in the fork
junhyeog/FedBABU) it tests the global model, not fine-tuned, on each client's test split.
Departures: the per-round PM curve is of fine-tuned models (the paper's per-round curve is not);
the fine-tuning lasts the wait-free window or ``pm_epochs``, not ``tau_f``; and the final PM is
the fine-tuning of the last global model a client trained on (version ``rounds``), not of the
final average (version ``rounds + 1``), which no client fine-tunes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from wafl.common.algorithms.base import BODY, Algorithm, Phase
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register


@dataclass(frozen=True)
class FedBABUParams:
    finetune: Literal["full", "head"] = param("full", "full|head")


def build(p: FedBABUParams, run: Mapping[str, Any]) -> Algorithm:
    return Algorithm(
        "fedbabu",
        phases=[Phase("body", params="body")],
        shares=BODY,
        personal="separate",
        pm_phase=Phase("finetune", params="all" if p.finetune == "full" else "head", main=False),
        pm_from_global=True,
        pm_when_unselected=True,
    )


register("fedbabu", FedBABUParams, build)

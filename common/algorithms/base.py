"""The pieces an algorithm is made of, and the context they read.

An algorithm is *declared*, not coded as a trainer: the loss terms added to cross-entropy for
the generic model (GM) and, for personalized methods, for the personalized model (PM); what
knowledge the client shares after training; and the server's update. One shared trainer
(:mod:`wafl.common.training`) and one client runtime run every algorithm, and composition
(``fedprox+asd``) is list concatenation.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.models.base import SplitModel

if TYPE_CHECKING:
    from wafl.common.knowledge import Knowledge


class RoundContext:
    """What a client knows during one round: the received global model and knowledge, its own state.

    ``teacher`` (a frozen eval-mode copy of the received global model) and ``global_params`` are
    built on first use only, so algorithms that need neither pay nothing.
    """

    def __init__(
        self,
        round: int,
        global_state: Mapping[str, torch.Tensor],
        gm: SplitModel,
        pm: SplitModel | None,
        label_freq: torch.Tensor,
        client_state: dict[str, Any],
        knowledge: Knowledge | None = None,
    ) -> None:
        self.round = round
        self.global_state = global_state
        self.gm = gm
        self.pm = pm
        self.label_freq = label_freq
        self.client_state = client_state
        self.knowledge = knowledge or {}

    @cached_property
    def teacher(self) -> SplitModel:
        t = copy.deepcopy(self.gm)
        t.load_state_dict(self.global_state)
        t.eval()
        for p in t.parameters():
            p.requires_grad_(False)
        return t

    @cached_property
    def global_params(self) -> list[torch.Tensor]:
        """The received global model's trainable parameters, in ``model.parameters()`` order, detached."""
        return [p.detach() for p in self.teacher.parameters()]


class Forward:
    """One batch's forward pass, shared by every loss term of the phase."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, logits: torch.Tensor, ctx: RoundContext
    ) -> None:
        self.x, self.y, self.h, self.logits, self._ctx = x, y, h, logits, ctx

    @cached_property
    def teacher_logits(self) -> torch.Tensor:
        with torch.no_grad():
            return self._ctx.teacher(self.x)


class LossTerm(ABC):
    """A term added to cross-entropy. ``begin``/``end`` run once per training phase."""

    name = "term"

    def begin(self, ctx: RoundContext, model: nn.Module) -> None:
        """Prepares per-round constants (anchors, teacher spectra, client state)."""

    @abstractmethod
    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        """The term's value on one batch (with its gradient)."""

    def end(self, ctx: RoundContext, model: nn.Module) -> None:
        """Updates client state once the phase has trained ``model``."""


class ServerUpdate:
    """The server side: how uploads are weighted and how their mean becomes the next global model.

    The default is FedAvg: weights are sample counts and the new global is the weighted mean.
    State kept across rounds goes through ``state_dict``/``load_state_dict`` into checkpoints.
    ``buffered_ok`` is False for updates that need one round's full models (their state would
    be built from stale deltas under buffered aggregation, which refuses them).
    """

    buffered_ok = True

    def weight(self, num_samples: int) -> float:
        return float(num_samples)

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        return mean

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


KnowledgeExtractor = Callable[
    [SplitModel, Iterable[tuple[torch.Tensor, torch.Tensor]], RoundContext, torch.Generator], "Knowledge"
]


@dataclass
class Algorithm:
    """A resolved algorithm: its name, validated parameters and parts."""

    name: str
    params: dict[str, Any]
    gm_terms: list[LossTerm] = field(default_factory=list)
    pm_terms: list[LossTerm] | None = None  # not None: the client keeps and trains a PM
    knowledge: KnowledgeExtractor | None = None  # shared after local training (FedHKD, FedProto)
    server: ServerUpdate = field(default_factory=ServerUpdate)
    local_model_is_personal: bool = False  # PM accuracy = the local model right after training
    privacy: Callable[[int], dict[str, Any]] | None = None  # releases -> the DP guarantee, for the record

    @property
    def personalized(self) -> bool:
        return self.pm_terms is not None


def cross_entropy(out: Forward) -> torch.Tensor:
    return F.cross_entropy(out.logits, out.y)

"""Server-update machinery shared by several methods: which tensors are weights (:func:`is_weight`,
:func:`is_statistic`),
how many clients train (:func:`training_clients`), and FedAvgM's momentum (state across rounds,
checkpointed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from wafl.common.algorithms.base import ServerUpdate
from wafl.common.algorithms.regularizers import fedavgm_update

_BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def is_statistic(name: str) -> bool:
    """Whether a tensor is a normalization statistic (BatchNorm's running mean, variance, count)."""
    return name.endswith(_BUFFER_SUFFIXES)


def is_weight(name: str, t: torch.Tensor) -> bool:
    """Floating tensors that are trained (not normalization statistics)."""
    return t.is_floating_point() and not is_statistic(name)


def training_clients(run: Mapping[str, Any]) -> int:
    """The clients that train, from the run configuration as a mapping: ``num_clients`` less the
    ``new_clients`` held out of training (``FederationSection.training_clients``; a mapping of the
    configuration has its fields, not its properties). A method whose server divides by "all
    clients" (FedDyn's ``h``, SCAFFOLD's ``c``) means these: a held-out client never uploads."""
    return int(run.get("num_clients", 1)) - int(run.get("new_clients", 0))


class MomentumUpdate(ServerUpdate):
    """FedAvgM: ``v <- beta v + (w - mean)``, ``w <- w - eta v`` on every trained tensor."""

    buffered_ok = False

    def __init__(self, beta: float, eta: float) -> None:
        self.beta, self.eta = beta, eta
        self.velocity: dict[str, torch.Tensor] = {}

    def finalize(
        self, prev: Mapping[str, torch.Tensor], mean: dict[str, torch.Tensor], participants: int
    ) -> dict[str, torch.Tensor]:
        out = dict(mean)
        for k, w in prev.items():
            if is_weight(k, w):
                v = self.velocity.get(k, torch.zeros_like(w))
                out[k], self.velocity[k] = fedavgm_update(w, mean[k], v, self.beta, self.eta)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": self.velocity}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.velocity = dict(state.get("velocity", {}))

"""The run's global model as it travels: the tensors every client is sent, the class knowledge that goes
with them, their manifest and size. One object shared by every part of the server that reads it (the
round loop replaces its tensors after each aggregation, a resume restores them)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from wafl.common.codec import Manifest, manifest_of
from wafl.common.knowledge import Knowledge


@dataclass
class GlobalModel:
    """The tensors of the model the algorithm shares, then its extra tensors (``state``), and the knowledge
    that travels with them; ``manifest`` and ``nbytes`` describe ``state`` (its shape never changes)."""

    state: OrderedDict[str, torch.Tensor]
    manifest: Manifest
    nbytes: int
    knowledge: Knowledge = field(default_factory=dict)

    @classmethod
    def of(cls, state: OrderedDict[str, torch.Tensor]) -> GlobalModel:
        manifest = manifest_of(state)
        return cls(state, manifest, sum(s.nbytes for s in manifest))

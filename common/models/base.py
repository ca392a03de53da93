"""The split that every wafl model follows: ``features(x) -> h`` then ``classifier(h) -> logits``.

FedHKD, FedProto, FedRep and FedRoD need the representation ``h``; every other algorithm only
calls the model. Keeping the split in one base class lets one trainer serve them all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from wafl.common.registry import Registry


class SplitModel(nn.Module):
    """A classifier made of a feature extractor ending in a ``code_len`` projection and a linear head."""

    def __init__(self, features: nn.Module, code_len: int, num_classes: int) -> None:
        super().__init__()
        self.features = features
        self.classifier = nn.Linear(code_len, num_classes)
        self.code_len = code_len
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(h, logits)`` from one pass."""
        h = self.features(x)
        return h, self.classifier(h)


def submodule(model: nn.Module, name: str) -> nn.Module:
    """``model.<name>`` as a module (``features``, ``classifier``, ...): a typed, checked attribute read."""
    part = getattr(model, name)
    if not isinstance(part, nn.Module):
        raise TypeError(f"{type(model).__name__}.{name} is a {type(part).__name__}, not a module")
    return part


# name -> builder(num_classes, in_channels, image_size, code_len) -> SplitModel; each builder's file registers it
# (@MODELS.register)
MODELS: Registry[Callable[..., SplitModel]] = Registry("model", "wafl.common.models")

"""The small CNN used on the embedded 8x8 digits (and any small single- or three-channel image)."""

from __future__ import annotations

from torch import nn
from wafl.common.models.base import MODELS, SplitModel


@MODELS.register("cnn")
def digits_cnn(num_classes: int = 10, in_channels: int = 1, image_size: int = 8, code_len: int = 32) -> SplitModel:
    """Two 3x3 convolutions, one 2x2 max-pool, a 128-unit hidden layer, a ``code_len`` projection."""
    pooled = image_size // 2
    features = nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * pooled * pooled, 128),
        nn.ReLU(),
        nn.Linear(128, code_len),
    )
    return SplitModel(features, code_len, num_classes)

"""Model registry: every model is a :class:`SplitModel` (``features`` then ``classifier``)."""

from __future__ import annotations

from collections.abc import Callable

from wafl.common.models.base import SplitModel
from wafl.common.models.cnn import digits_cnn
from wafl.common.models.cnn2 import cnn2, cnn2_same
from wafl.common.models.lenet5 import lenet5
from wafl.common.models.resnet import resnet18, resnet34, resnet50
from wafl.common.models.shufflenet import shufflenetv2

# name -> builder(num_classes, in_channels, image_size, code_len) -> SplitModel
MODELS: dict[str, Callable[..., SplitModel]] = {
    "cnn": digits_cnn,
    "lenet5": lenet5,
    "cnn2": cnn2,
    "cnn2-same": cnn2_same,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "shufflenetv2": shufflenetv2,
}


def build_model(name: str, num_classes: int, in_channels: int, image_size: int, code_len: int = 32) -> SplitModel:
    """Builds a registered model; an unknown name raises ``ValueError`` listing the known ones."""
    try:
        builder = MODELS[name]
    except KeyError:
        raise ValueError(f"model={name!r} is not one of {sorted(MODELS)}") from None
    return builder(num_classes=num_classes, in_channels=in_channels, image_size=image_size, code_len=code_len)


__all__ = ["MODELS", "SplitModel", "build_model"]

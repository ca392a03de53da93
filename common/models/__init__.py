"""Model registry: every model is a :class:`SplitModel` (``features`` then ``classifier``). A new model is one
file in this package whose builder carries ``@MODELS.register("name")`` (:mod:`wafl.common.registry`)."""

from __future__ import annotations

from wafl.common.models.base import MODELS, SplitModel


def build_model(name: str, num_classes: int, in_channels: int, image_size: int, code_len: int = 32) -> SplitModel:
    """Builds a registered model; an unknown name raises ``ValueError`` listing the known ones."""
    builder = MODELS.lookup(name)
    return builder(num_classes=num_classes, in_channels=in_channels, image_size=image_size, code_len=code_len)


__all__ = ["MODELS", "SplitModel", "build_model"]

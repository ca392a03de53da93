"""The two-convolution CNN of McMahan et al. (2017, "Communication-Efficient Learning of Deep
Networks from Decentralized Data") for 28x28 grey images.

5x5 convolutions of 32 and 64 channels, each followed by ReLU and a 2x2 max-pool, a 512-unit
fully connected layer with ReLU, and the classifier. ``cnn2`` convolves without padding
(28 -> 24 -> 12 -> 8 -> 4), the common re-implementation: 582,026 parameters for 10 classes at
``code_len`` 512. ``cnn2-same`` pads the convolutions ("same", 28 -> 14 -> 7), which gives the
paper's stated 1,663,370. With any other ``code_len`` the features end, as every wafl model's
do, in a linear projection 512 -> ``code_len``.
"""

from __future__ import annotations

from torch import nn
from wafl.common.models.base import MODELS, SplitModel
from wafl.common.models.lenet5 import conv_features, representation

HIDDEN = 512  # the fully connected layer


def _cnn2(num_classes: int, in_channels: int, image_size: int, code_len: int, padding: int) -> SplitModel:
    convs, flat = conv_features(in_channels, image_size, (32, 64), padding=padding)
    features = nn.Sequential(convs, nn.Linear(flat, HIDDEN), nn.ReLU(), *representation(HIDDEN, code_len))
    return SplitModel(features, code_len, num_classes)


@MODELS.register("cnn2")
def cnn2(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, code_len: int = HIDDEN) -> SplitModel:
    """McMahan et al.'s CNN with unpadded convolutions (582,026 parameters at 10 classes, ``code_len`` 512)."""
    return _cnn2(num_classes, in_channels, image_size, code_len, padding=0)


@MODELS.register("cnn2-same")
def cnn2_same(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, code_len: int = HIDDEN) -> SplitModel:
    """McMahan et al.'s CNN with "same" padding (1,663,370 parameters at 10 classes, ``code_len`` 512)."""
    return _cnn2(num_classes, in_channels, image_size, code_len, padding=2)


__all__ = ["cnn2", "cnn2_same"]

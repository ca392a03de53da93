"""LeNet-5 (LeCun et al. 1998) as federated-learning papers use it on 28x28 grey images.

Two 5x5 convolutions without padding (6 then 16 channels), each followed by ReLU and a 2x2
max-pool (28 -> 24 -> 12 -> 8 -> 4), then fully connected layers of 120 and 84 units with ReLU.
``features`` ends at the 84 units and the :class:`SplitModel` head maps them to the classes:
44,426 parameters for 10 classes at ``code_len`` 84. With any other ``code_len`` the features
end, as every wafl model's do, in a linear projection 84 -> ``code_len`` (46,626 parameters at
the default 32).
"""

from __future__ import annotations

from torch import nn
from wafl.common.models.base import MODELS, SplitModel

HIDDEN = 84  # LeNet-5's last hidden layer


def conv_features(in_channels: int, image_size: int, channels: tuple[int, int], padding: int) -> tuple[nn.Module, int]:
    """Two 5x5 convolutions with ReLU, each followed by a 2x2 max-pool, then flatten; returns the
    module and the length of its output (``ValueError`` for an image too small for it)."""
    side = image_size
    for _ in channels:
        side = (side + 2 * padding - 4) // 2
    if side < 1:
        raise ValueError(f"image_size={image_size} is too small for two 5x5 convolutions and 2x2 poolings")
    c1, c2 = channels
    module = nn.Sequential(
        nn.Conv2d(in_channels, c1, 5, padding=padding),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=padding),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return module, c2 * side * side


def representation(hidden: int, code_len: int) -> list[nn.Module]:
    """Nothing when ``code_len`` is the network's own last hidden width, else a projection to ``code_len``."""
    return [] if code_len == hidden else [nn.Linear(hidden, code_len)]


@MODELS.register("lenet5")
def lenet5(num_classes: int = 10, in_channels: int = 1, image_size: int = 28, code_len: int = HIDDEN) -> SplitModel:
    """LeNet-5: conv 5x5 6, pool, conv 5x5 16, pool, fc 120, fc 84, then the classifier."""
    convs, flat = conv_features(in_channels, image_size, (6, 16), padding=0)
    features = nn.Sequential(
        convs,
        nn.Linear(flat, 120),
        nn.ReLU(),
        nn.Linear(120, HIDDEN),
        nn.ReLU(),
        *representation(HIDDEN, code_len),
    )
    return SplitModel(features, code_len, num_classes)


__all__ = ["conv_features", "lenet5", "representation"]

"""CIFAR-style ResNet-18/34/50 on torchvision's definitions, split as ``features`` + ``classifier``.

The ImageNet stem (7x7 stride-2 convolution then a 3x3 stride-2 max-pool, a 4x reduction meant
for 224px inputs) is replaced by one 3x3 stride-1 convolution and no pooling, so 32x32 inputs
keep their resolution into ``layer1`` and leave ``layer4`` at 4x4. ``fc`` is dropped:
``features`` is stem + ``layer1..4`` + global average pool + flatten + a linear projection to
``code_len``, and the :class:`SplitModel` head maps ``code_len`` to the classes.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn
from wafl.common.models.base import MODELS, SplitModel


def cifar_stem_conv(in_channels: int, out_channels: int) -> nn.Conv2d:
    """A 3x3 stride-1 convolution, initialized as torchvision initializes its ResNet convolutions."""
    conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    return conv


def _cifar_resnet(arch: str, num_classes: int, in_channels: int, code_len: int) -> SplitModel:
    from torchvision import models

    net = getattr(models, arch)(weights=None)
    backbone_dim = net.fc.in_features  # 512 for resnet18/34, 2048 for resnet50
    features = nn.Sequential(
        OrderedDict(
            conv1=cifar_stem_conv(in_channels, net.conv1.out_channels),
            bn1=net.bn1,
            relu=net.relu,
            layer1=net.layer1,
            layer2=net.layer2,
            layer3=net.layer3,
            layer4=net.layer4,
            pool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            projection=nn.Linear(backbone_dim, code_len),
        )
    )
    return SplitModel(features, code_len, num_classes)


@MODELS.register("resnet18")
def resnet18(num_classes: int = 10, in_channels: int = 3, image_size: int = 32, code_len: int = 32) -> SplitModel:
    """ResNet-18 (basic blocks 2-2-2-2, 512-d backbone) with the CIFAR stem; any ``image_size``."""
    return _cifar_resnet("resnet18", num_classes, in_channels, code_len)


@MODELS.register("resnet34")
def resnet34(num_classes: int = 10, in_channels: int = 3, image_size: int = 32, code_len: int = 32) -> SplitModel:
    """ResNet-34 (basic blocks 3-4-6-3, 512-d backbone) with the CIFAR stem; any ``image_size``."""
    return _cifar_resnet("resnet34", num_classes, in_channels, code_len)


@MODELS.register("resnet50")
def resnet50(num_classes: int = 10, in_channels: int = 3, image_size: int = 32, code_len: int = 32) -> SplitModel:
    """ResNet-50 (bottlenecks 3-4-6-3, 2048-d backbone) with the CIFAR stem; any ``image_size``."""
    return _cifar_resnet("resnet50", num_classes, in_channels, code_len)


__all__ = ["cifar_stem_conv", "resnet18", "resnet34", "resnet50"]

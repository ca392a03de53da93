"""ShuffleNetV2 (1.0x) on torchvision's definition with a CIFAR-friendly stem.

torchvision's stem is a 3x3 stride-2 convolution then a 3x3 stride-2 max-pool; here the
convolution has stride 1 and there is no max-pool, so the three stride-2 stages take a 32x32
input to 4x4. ``fc`` is dropped: ``features`` is stem + ``stage2..4`` + ``conv5`` (1024
channels) + global average pool + flatten + a linear projection to ``code_len``, and the
:class:`SplitModel` head maps ``code_len`` to the classes.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn
from wafl.common.models.base import MODELS, SplitModel
from wafl.common.models.resnet import cifar_stem_conv


@MODELS.register("shufflenetv2")
def shufflenetv2(num_classes: int = 10, in_channels: int = 3, image_size: int = 32, code_len: int = 32) -> SplitModel:
    """ShuffleNetV2 x1.0 (stages of 116, 232, 464 channels) with the CIFAR stem; any ``image_size``."""
    from torchvision import models

    net = models.shufflenet_v2_x1_0(weights=None)
    stem = net.conv1  # Sequential(conv 3x3 stride 2, BatchNorm, ReLU)
    stem[0] = cifar_stem_conv(in_channels, stem[0].out_channels)
    backbone_dim = net.fc.in_features  # 1024, the output of conv5
    features = nn.Sequential(
        OrderedDict(
            conv1=stem,
            stage2=net.stage2,
            stage3=net.stage3,
            stage4=net.stage4,
            conv5=net.conv5,
            pool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            projection=nn.Linear(backbone_dim, code_len),
        )
    )
    return SplitModel(features, code_len, num_classes)


__all__ = ["shufflenetv2"]

"""The CIFAR-style ResNets and ShuffleNetV2: split, shapes, stem, parameter counts, gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from wafl.common.models import MODELS, SplitModel, build_model

NETS = ["resnet18", "resnet34", "resnet50", "shufflenetv2"]

# Parameters with num_classes=10, in_channels=3, code_len=512, counted once with
# sum(p.numel() for p in model.parameters()). Each equals torchvision's ImageNet model
# (weights=None, 1000 classes) minus its stem convolution and fc, plus the 3x3 stem convolution,
# the projection to code_len and the 10-class head:
#   resnet18: 11,689,512 - 9,408 (7x7 conv) + 1,728 (3x3 conv) - 513,000 (fc 512->1000)
#             + 262,656 (projection 512->512) + 5,130 (head 512->10)           = 11,436,618
#   resnet34: 21,797,672 - 9,408 + 1,728 - 513,000 + 262,656 + 5,130          = 21,544,778
#   resnet50: 25,557,032 - 9,408 + 1,728 - 2,049,000 (fc 2048->1000)
#             + 1,049,088 (projection 2048->512) + 5,130                       = 24,554,570
#   shufflenetv2: 2,278,604 (the 3x3 stem keeps its 648 weights, only its stride changes)
#             - 1,025,000 (fc 1024->1000) + 524,800 (projection 1024->512) + 5,130 = 1,783,534
PARAMETERS = {
    "resnet18": 11_436_618,
    "resnet34": 21_544_778,
    "resnet50": 24_554_570,
    "shufflenetv2": 1_783_534,
}
BACKBONE_DIM = {"resnet18": 512, "resnet34": 512, "resnet50": 2048, "shufflenetv2": 1024}


@pytest.fixture(scope="module")
def nets() -> dict[str, SplitModel]:
    torch.manual_seed(0)
    return {name: build_model(name, num_classes=10, in_channels=3, image_size=32, code_len=512) for name in NETS}


def first_conv(model: nn.Module) -> nn.Conv2d:
    return next(m for m in model.modules() if isinstance(m, nn.Conv2d))


def test_registered():
    assert set(NETS) <= set(MODELS)


@pytest.mark.parametrize("name", NETS)
def test_parameter_count(nets, name):
    model = nets[name]
    assert isinstance(model, SplitModel)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]
    projection = model.features[-1]
    assert isinstance(projection, nn.Linear)
    assert (projection.in_features, projection.out_features) == (BACKBONE_DIM[name], 512)
    assert (model.classifier.in_features, model.classifier.out_features) == (512, 10)


@pytest.mark.parametrize("name", NETS)
def test_forward_shapes_at_32_and_64(nets, name):
    model = nets[name].eval()
    with torch.no_grad():
        for size in (32, 64):
            x = torch.randn(2, 3, size, size)
            h, logits = model.forward_split(x)
            assert h.shape == (2, 512) and logits.shape == (2, 10)
            assert torch.isfinite(logits).all()
            torch.testing.assert_close(model(x), logits)


@pytest.mark.parametrize("name", NETS)
def test_cifar_stem_keeps_resolution(nets, name):
    model = nets[name].eval()
    conv = first_conv(model)
    assert conv.kernel_size == (3, 3) and conv.stride == (1, 1) and conv.padding == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    assert not hasattr(model.features, "fc")
    # Everything before the first downsampling stage leaves 32x32 inputs at 32x32.
    stem_end = "layer1" if name.startswith("resnet") else "conv1"
    names = [n for n, _ in model.features.named_children()]
    with torch.no_grad():
        out = model.features[: names.index(stem_end) + 1](torch.randn(1, 3, 32, 32))
    assert out.shape[-2:] == (32, 32)


@pytest.mark.parametrize("name", ["resnet18", "shufflenetv2"])
def test_default_code_len_and_single_channel_input(name):
    model = build_model(name, num_classes=7, in_channels=1, image_size=32)  # code_len: the registry's 32
    conv = first_conv(model)
    assert conv.in_channels == 1 and conv.weight.shape[1:] == (1, 3, 3)
    assert model.code_len == 32 and model.features[-1].out_features == 32
    model.eval()
    with torch.no_grad():
        h, logits = model.forward_split(torch.randn(2, 1, 32, 32))
    assert h.shape == (2, 32) and logits.shape == (2, 7)


@pytest.mark.parametrize("name", ["resnet18", "shufflenetv2"])
def test_gradients_reach_first_conv(name):
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, in_channels=3, image_size=32, code_len=16).train()
    loss = nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 7]))
    loss.backward()
    grad = first_conv(model).weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert model.features[-1].weight.grad.abs().sum() > 0

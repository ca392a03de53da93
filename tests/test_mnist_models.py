"""LeNet-5 and McMahan et al.'s two-convolution CNN: parameter counts, layers, shapes, and short
federations on a slice of the real Fashion-MNIST files with the methods that use the split."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from wafl.cli.sim.simulate import simulate
from wafl.common.config import load_config
from wafl.common.datasets.idx import FASHION_DIR, FASHION_FILES, IMAGES_MAGIC, LABELS_MAGIC, read_idx
from wafl.common.models import MODELS, SplitModel, build_model

# Parameters for 10 classes, counted by hand:
#   lenet5 (no padding, 28 -> 24 -> 12 -> 8 -> 4): conv 1->6 5x5 156, conv 6->16 5x5 2,416,
#     fc 256->120 30,840, fc 120->84 10,164, classifier 84->10 850                    = 44,426
#   cnn2 (no padding): conv 1->32 5x5 832, conv 32->64 5x5 51,264, fc 1024->512 524,800,
#     classifier 512->10 5,130                                                         = 582,026
#   cnn2-same (28 -> 14 -> 7): fc 3136->512 1,606,144 instead                         = 1,663,370
# (McMahan et al. 2017 state 1,663,370 for their CNN.) With another code_len, a projection
# hidden -> code_len is added and the classifier reads code_len units:
#   lenet5 at 32: 44,426 - 850 + (84*32 + 32) + (32*10 + 10)                          = 46,626
NATIVE = {"lenet5": (84, 44_426), "cnn2": (512, 582_026), "cnn2-same": (512, 1_663_370)}


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_parameter_count_and_split_at_native_width(name):
    width, params = NATIVE[name]
    model = build_model(name, num_classes=10, in_channels=1, image_size=28, code_len=width)
    assert isinstance(model, SplitModel) and name in MODELS
    assert count(model) == params
    assert model.code_len == width
    assert isinstance(model.features[-1], nn.ReLU)  # no projection: the paper's network exactly
    assert (model.classifier.in_features, model.classifier.out_features) == (width, 10)
    with torch.no_grad():
        h, logits = model.eval().forward_split(torch.randn(3, 1, 28, 28))
    assert h.shape == (3, width) and logits.shape == (3, 10) and (h >= 0).all()
    torch.testing.assert_close(
        model(torch.zeros(2, 1, 28, 28)), model.classifier(model.features(torch.zeros(2, 1, 28, 28)))
    )


def test_layers_follow_the_papers():
    convs = {
        name: [
            (m.in_channels, m.out_channels, m.kernel_size, m.padding)
            for m in model.modules()
            if isinstance(m, nn.Conv2d)
        ]
        for name, model in ((n, build_model(n, 10, 1, 28, NATIVE[n][0])) for n in NATIVE)
    }
    assert convs["lenet5"] == [(1, 6, (5, 5), (0, 0)), (6, 16, (5, 5), (0, 0))]
    assert convs["cnn2"] == [(1, 32, (5, 5), (0, 0)), (32, 64, (5, 5), (0, 0))]
    assert convs["cnn2-same"] == [(1, 32, (5, 5), (2, 2)), (32, 64, (5, 5), (2, 2))]
    fcs = [
        (m.in_features, m.out_features)
        for m in build_model("lenet5", 10, 1, 28, 84).modules()
        if isinstance(m, nn.Linear)
    ]
    assert fcs == [(256, 120), (120, 84), (84, 10)]
    fcs = [
        (m.in_features, m.out_features)
        for m in build_model("cnn2", 10, 1, 28, 512).modules()
        if isinstance(m, nn.Linear)
    ]
    assert fcs == [(1024, 512), (512, 10)]


def test_other_code_len_adds_a_projection():
    model = build_model("lenet5", num_classes=26, in_channels=1, image_size=28, code_len=32)
    assert (
        count(model) == 44_426 - 850 + (84 * 32 + 32) + (32 * 26 + 26)
        and count(build_model("lenet5", 10, 1, 28, 32)) == 46_626
    )
    assert isinstance(model.features[-1], nn.Linear) and model.features[-1].out_features == 32
    h, logits = model.forward_split(torch.randn(2, 1, 28, 28))
    assert h.shape == (2, 32) and logits.shape == (2, 26)


def test_too_small_images_are_refused():
    with pytest.raises(ValueError, match="image_size=8"):
        build_model("lenet5", num_classes=10, in_channels=1, image_size=8)


# ---------------------------------------------------------------------------------------------
# Short federations on 2,400 training and 600 test images of the real Fashion-MNIST, written as
# an MNIST-format folder and read through mnist-idx.


@pytest.fixture(scope="module")
def fmnist_slice(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fmnist-slice")
    for role, n in (("train", 2400), ("test", 600)):
        prefix = "train" if role == "train" else "t10k"
        images = read_idx(str(Path(FASHION_DIR) / FASHION_FILES[f"{role}_images"]), IMAGES_MAGIC, "")[:n]
        labels = read_idx(str(Path(FASHION_DIR) / FASHION_FILES[f"{role}_labels"]), LABELS_MAGIC, "")[:n]
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">IIII", IMAGES_MAGIC, n, 28, 28) + images.tobytes())
        )
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">II", LABELS_MAGIC, n) + labels.tobytes())
        )
    return folder


@pytest.mark.parametrize(
    ("model", "algorithm"),
    [("lenet5", "fedavg"), ("lenet5", "fedrep"), ("lenet5", "fedhkd"), ("cnn2", "fedrod"), ("cnn2", "fedbabu")],
)
def test_short_federation_learns(fmnist_slice, model, algorithm):
    cfg = load_config(
        None,
        {
            "dataset": "mnist-idx",
            "data_dir": str(fmnist_slice),
            "model": model,
            "code_len": NATIVE[model][0],
            "algorithm": algorithm,
            "num_clients": 4,
            "alpha": 1.0,
            "rounds": 3,
            "local_epochs": 1,
            "lr": 0.05,
            "protocol": "compute-and-wait",
            "checkpoint": False,
        },
    )
    rows = simulate(cfg)
    final = rows[-1]
    accuracies = [a for a in (final["gm_accuracy"], final["pm_accuracy"]) if a is not None]
    # chance: 0.1; FedRep's PM is the global body with the personal head (0.39 after these 3 rounds), not the
    # client's own trained body it was scored on before
    assert accuracies and min(accuracies) > (0.3 if algorithm == "fedrep" else 0.4), final
    assert np.isfinite(final["gm_accuracy"] if final["gm_accuracy"] is not None else 0.0)

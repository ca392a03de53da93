"""Synthetic image data of a real dataset's shape, for smoke tests, GPU checks and benchmarks.

Each class is a fixed random template plus noise, so a model can learn it (accuracy above
chance means training works) while nothing has to be downloaded. Deterministic from a seed.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
from wafl.common.datasets.base import DATASETS, FederatedDataset
from wafl.common.datasets.digits import LabeledTensorDataset

SHAPES = {
    # name: (channels, size, classes, train, test)
    "synthetic-cifar10": (3, 32, 10, 1000, 200),
    "synthetic-cifar100": (3, 32, 100, 2000, 400),
    # CIFAR-10's sizes as well as its shapes: a fleet of 100 clients with 500 images each (benchmarks/gpu_fleet.py)
    "synthetic-cifar10-50k": (3, 32, 10, 50000, 10000),
    "synthetic-svhn": (3, 32, 10, 1000, 200),
    "synthetic-tinyimagenet": (3, 64, 200, 2000, 400),
    # digits' shape with enough samples for every client of a 10,000-client federation (benchmarks/scale.py)
    "synthetic-digits": (1, 8, 10, 50000, 400),
}


def load_synthetic(name: str, data_dir: str | None = None, seed: int = 0) -> FederatedDataset:
    channels, size, classes, n_train, n_test = SHAPES[name]
    rng = np.random.default_rng(seed)
    templates = rng.normal(0, 1, size=(classes, channels, size, size)).astype(np.float32)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = np.arange(n) % classes
        rng.shuffle(y)
        x = templates[y] + rng.normal(0, 1.0, size=(n, channels, size, size)).astype(np.float32)
        return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))

    tx, ty = make(n_train)
    vx, vy = make(n_test)
    return FederatedDataset(
        name,
        LabeledTensorDataset(tx, ty),
        LabeledTensorDataset(vx, vy),
        ty.numpy(),
        vy.numpy(),
        classes,
        channels,
        size,
    )


LOADERS = {name: partial(load_synthetic, name) for name in SHAPES}
for _name, _loader in LOADERS.items():
    DATASETS.add(_name, _loader)

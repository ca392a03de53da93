"""SVHN (cropped digits, format 2) from the official ``.mat`` files.

Layout under ``data_dir``: ``svhn/train_32x32.mat`` and ``svhn/test_32x32.mat``. Each holds
``X`` of shape ``(32, 32, 3, N)`` uint8 and ``y`` of shape ``(N, 1)`` with labels 1..10, where
10 stands for the digit 0; labels are mapped so that label == digit (10 -> 0).
"""

from __future__ import annotations

import os

import numpy as np
from wafl.common.datasets.base import DATASETS, DatasetNotFoundError, FederatedDataset, not_found
from wafl.common.datasets.cifar import ArrayImageDataset
from wafl.common.datasets.transforms import eval_transform, train_transform

SVHN_URL = "http://ufldl.stanford.edu/housenumbers/"
FOLDER = "svhn"
TRAIN_FILE = "train_32x32.mat"
TEST_FILE = "test_32x32.mat"
IMAGE_SIZE = 32
NUM_CLASSES = 10


def _not_found(data_dir: str | None, missing: list[str] | None = None) -> DatasetNotFoundError:
    expected = [TRAIN_FILE, TEST_FILE]
    how = f"download {', '.join(expected)} (format 2, cropped digits) from {SVHN_URL} into"
    return not_found(
        "svhn", FOLDER, ", ".join(expected), how, data_dir, f"missing {', '.join(missing or expected)}", into="folder"
    )


def _read_mat(path: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 32, 32, 3) uint8, labels (N,) int64 in 0..9)``."""
    from scipy.io import loadmat

    mat = loadmat(path)
    if "X" not in mat or "y" not in mat:
        found = sorted(k for k in mat if not k.startswith("__"))
        raise ValueError(f"{path}: expected variables 'X' and 'y', found {found}")
    x = np.asarray(mat["X"])
    y = np.asarray(mat["y"]).reshape(-1).astype(np.int64)
    if x.ndim != 4 or x.shape[:3] != (IMAGE_SIZE, IMAGE_SIZE, 3) or x.shape[3] != len(y):
        raise ValueError(f"{path}: X {x.shape} and y of {len(y)} labels are not (32, 32, 3, N) and N labels")
    if len(y) and (y.min() < 0 or y.max() > NUM_CLASSES):
        raise ValueError(f"{path}: labels must be digits 1..10 (10 for 0), found {y.min()}..{y.max()}")
    y[y == 10] = 0
    images = np.ascontiguousarray(x.astype(np.uint8, copy=False).transpose(3, 0, 1, 2))
    return images, y


@DATASETS.register("svhn")
def load_svhn(data_dir: str | None) -> FederatedDataset:
    """SVHN: 73257 train, 26032 test, 10 classes (label == digit), 32x32 RGB; no horizontal flips."""
    if data_dir is None:
        raise _not_found(None)
    folder = os.path.join(data_dir, FOLDER)
    missing = [f for f in (TRAIN_FILE, TEST_FILE) if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise _not_found(data_dir, missing)
    train_x, train_y = _read_mat(os.path.join(folder, TRAIN_FILE))
    test_x, test_y = _read_mat(os.path.join(folder, TEST_FILE))
    return FederatedDataset(
        name="svhn",
        train=ArrayImageDataset(train_x, train_y, train_transform("svhn", IMAGE_SIZE)),
        test=ArrayImageDataset(test_x, test_y, eval_transform("svhn", IMAGE_SIZE)),
        train_labels=train_y,
        test_labels=test_y,
        num_classes=NUM_CLASSES,
        in_channels=3,
        image_size=IMAGE_SIZE,
    )


__all__ = ["load_svhn"]

"""scikit-learn's bundled 8x8 handwritten digits: the embedded real dataset (no download)."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset
from wafl.common.datasets.base import DATASETS, DatasetNotFoundError, FederatedDataset

TEST_FRACTION = 0.2
SPLIT_SEED = 0


class LabeledTensorDataset(TensorDataset):
    """A ``TensorDataset`` of ``(x, y)`` whose tensors the trainer can slice directly (no collate)."""


def digits_file() -> Path:
    """scikit-learn's ``digits.csv.gz`` (64 pixels and the label a row), found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise DatasetNotFoundError("dataset=digits needs scikit-learn's bundled digits: pip install scikit-learn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DatasetNotFoundError(f"dataset=digits: {path} is missing; reinstall it: pip install scikit-learn")
    return path


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images (1797, 8, 8) and labels as ``sklearn.datasets.load_digits`` gives them (the same file, read
    the same way), in milliseconds instead of the seconds that importing scikit-learn costs."""
    with gzip.open(digits_file(), "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)


@DATASETS.register("digits")
def load_digits_dataset(data_dir: str | None = None) -> FederatedDataset:
    """1797 images, a fixed stratified 80/20 split (seed 0): 1437 train, 360 test; pixels scaled to [0, 1]."""
    images, target = read_digits()
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    y = target.astype(np.int64)
    rng = np.random.default_rng(SPLIT_SEED)
    test_idx: list[int] = []
    for c in range(10):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test_idx.extend(idx[: int(round(TEST_FRACTION * len(idx)))].tolist())
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[test_idx] = True
    train_x, train_y = x[~test_mask], y[~test_mask]
    test_x, test_y = x[test_mask], y[test_mask]
    return FederatedDataset(
        name="digits",
        train=LabeledTensorDataset(torch.from_numpy(train_x), torch.from_numpy(train_y)),
        test=LabeledTensorDataset(torch.from_numpy(test_x), torch.from_numpy(test_y)),
        train_labels=train_y,
        test_labels=test_y,
        num_classes=10,
        in_channels=1,
        image_size=8,
    )

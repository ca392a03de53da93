"""CIFAR-10 and CIFAR-100 from the "python version" pickle batches of the CIFAR site.

Layout under ``data_dir`` (what extracting the official archives gives)::

    cifar-10-batches-py/data_batch_1 .. data_batch_5, test_batch   (keys b"data", b"labels")
    cifar-100-python/train, test                                   (keys b"data", b"fine_labels")

``b"data"`` is an ``(N, 3072)`` uint8 array, each row the red, green then blue 32x32 planes.
The batches are read with :mod:`pickle` directly (no torchvision dataset class, so nothing can
trigger a download), through an unpickler that only rebuilds numpy arrays.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from wafl.common.datasets.base import DATASETS, DatasetNotFoundError, FederatedDataset, not_found
from wafl.common.datasets.transforms import eval_transform, train_transform

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
IMAGE_SIZE = 32


class ArrayImageDataset(Dataset[tuple[Any, int]]):
    """Images held as one ``(N, H, W, 3)`` uint8 array; ``transform`` turns each into a tensor."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Callable[[Image.Image], Any]) -> None:
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"images must be (N, H, W, 3) uint8, got {images.shape} {images.dtype}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self.transform(Image.fromarray(self.images[index])), int(self.labels[index])


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Rebuilds the numpy arrays, dicts, lists and bytes of a CIFAR batch and refuses anything else."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        # Python 3 writes bytes as _codecs.encode(str, "latin1") under pickle protocols 0-2.
        ("_codecs", "encode"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR batch")


def _read_batch(path: str, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 32, 32, 3) uint8, labels (N,) int64)`` of one pickle batch."""
    with open(path, "rb") as f:
        raw = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in raw.items()}
    if "data" not in batch or label_key not in batch:
        raise ValueError(f"{path}: expected keys 'data' and {label_key!r}, found {sorted(batch)}")
    data = np.asarray(batch["data"], dtype=np.uint8)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3 * IMAGE_SIZE * IMAGE_SIZE or len(data) != len(labels):
        raise ValueError(f"{path}: data {data.shape} and {labels.shape} labels are not (N, 3072) and (N,)")
    images = data.reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def _not_found(
    name: str, archive: str, folder: str, expected: list[str], data_dir: str | None, missing: list[str] | None = None
) -> DatasetNotFoundError:
    how = f"download {archive} (python version) from {CIFAR_URL} and extract it into"
    return not_found(name, folder, ", ".join(expected), how, data_dir, f"missing {', '.join(missing or expected)}")


def _load_cifar(
    name: str,
    data_dir: str | None,
    folder: str,
    archive: str,
    train_files: list[str],
    test_files: list[str],
    label_key: str,
    num_classes: int,
) -> FederatedDataset:
    expected = train_files + test_files
    if data_dir is None:
        raise _not_found(name, archive, folder, expected, None)
    base = os.path.join(data_dir, folder)
    missing = [f for f in expected if not os.path.isfile(os.path.join(base, f))]
    if missing:
        raise _not_found(name, archive, folder, expected, data_dir, missing)

    def read(files: list[str]) -> tuple[np.ndarray, np.ndarray]:
        parts = [_read_batch(os.path.join(base, f), label_key) for f in files]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if len(bad):
            raise ValueError(f"dataset {name!r}: label {int(bad[0])} outside [0, {num_classes}) in {base}")
        return images, labels

    train_x, train_y = read(train_files)
    test_x, test_y = read(test_files)
    return FederatedDataset(
        name=name,
        train=ArrayImageDataset(train_x, train_y, train_transform(name, IMAGE_SIZE)),
        test=ArrayImageDataset(test_x, test_y, eval_transform(name, IMAGE_SIZE)),
        train_labels=train_y,
        test_labels=test_y,
        num_classes=num_classes,
        in_channels=3,
        image_size=IMAGE_SIZE,
    )


@DATASETS.register("cifar10")
def load_cifar10(data_dir: str | None) -> FederatedDataset:
    """CIFAR-10: 50000 train (data_batch_1..5), 10000 test (test_batch), 10 classes, 32x32 RGB."""
    return _load_cifar(
        "cifar10",
        data_dir,
        folder="cifar-10-batches-py",
        archive="cifar-10-python.tar.gz",
        train_files=[f"data_batch_{i}" for i in range(1, 6)],
        test_files=["test_batch"],
        label_key="labels",
        num_classes=10,
    )


@DATASETS.register("cifar100")
def load_cifar100(data_dir: str | None) -> FederatedDataset:
    """CIFAR-100 with its 100 fine labels: 50000 train, 10000 test, 32x32 RGB."""
    return _load_cifar(
        "cifar100",
        data_dir,
        folder="cifar-100-python",
        archive="cifar-100-python.tar.gz",
        train_files=["train"],
        test_files=["test"],
        label_key="fine_labels",
        num_classes=100,
    )


__all__ = ["ArrayImageDataset", "load_cifar10", "load_cifar100"]

"""Any image classification set laid out as class folders (iNaturalist subsets and the like).

Layout under ``data_dir``::

    imagefolder/train/<class>/<image>     (nested folders inside a class folder are walked too)
    imagefolder/test/<class>/<image>

The classes are the sorted names of the train class folders, label = position in that list. A
test class folder that has no train counterpart is an error. Only file paths are listed when
loading: each image is opened, converted to RGB and resized when it is fetched, so the set
may be far larger than memory. Resizing scales the shorter side to ``image_size`` and keeps
the central square.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from wafl.common.datasets.base import DATASETS, DatasetNotFoundError, FederatedDataset, not_found
from wafl.common.datasets.transforms import eval_transform, train_transform

FOLDER = "imagefolder"
DEFAULT_IMAGE_SIZE = 64
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class ImageFileDataset(Dataset[tuple[Any, int]]):
    """Images read from disk on each access: ``(transform(RGB image), label)``."""

    def __init__(self, paths: Sequence[str], labels: np.ndarray, transform: Callable[[Image.Image], Any]) -> None:
        if len(paths) != len(labels):
            raise ValueError(f"{len(paths)} image paths but {len(labels)} labels")
        self.paths = list(paths)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        with Image.open(self.paths[index]) as img:
            rgb = img.convert("RGB")
        return self.transform(rgb), int(self.labels[index])


def image_files_dataset(
    name: str,
    train: tuple[Sequence[str], np.ndarray],
    test: tuple[Sequence[str], np.ndarray],
    num_classes: int,
    image_size: int,
) -> FederatedDataset:
    """An RGB image-file dataset (paths and labels per split), resized to ``image_size``."""
    return FederatedDataset(
        name=name,
        train=ImageFileDataset(train[0], train[1], train_transform(name, image_size, resize=True)),
        test=ImageFileDataset(test[0], test[1], eval_transform(name, image_size, resize=True)),
        train_labels=train[1],
        test_labels=test[1],
        num_classes=num_classes,
        in_channels=3,
        image_size=image_size,
    )


def is_image_file(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _subfolders(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _images_under(path: str) -> list[str]:
    """The image files below ``path``, in a fixed (sorted) order."""
    found: list[str] = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(os.path.join(root, f) for f in sorted(files) if is_image_file(f))
    return found


def _not_found(data_dir: str | None, problem: str | None = None) -> DatasetNotFoundError:
    expected = "train/<class>/<image> and test/<class>/<image> (one folder per class, JPEG/PNG/... images)"
    how = (
        "put the images of each class in a folder named after the class (e.g. extract an iNaturalist subset "
        "and arrange it by species) under"
    )
    return not_found("imagefolder", FOLDER, expected, how, data_dir, problem, into="folder")


@DATASETS.register("imagefolder")
def load_imagefolder(data_dir: str | None, image_size: int = DEFAULT_IMAGE_SIZE) -> FederatedDataset:
    """Class folders under ``<data_dir>/imagefolder/{train,test}``, images resized to ``image_size``."""
    if data_dir is None:
        raise _not_found(None)
    root = os.path.join(data_dir, FOLDER)
    train_dir, test_dir = os.path.join(root, "train"), os.path.join(root, "test")
    missing = [d for d in ("train", "test") if not os.path.isdir(os.path.join(root, d))]
    if missing:
        raise _not_found(data_dir, f"missing folder(s) {', '.join(d + '/' for d in missing)}")

    classes = _subfolders(train_dir)
    if not classes:
        raise _not_found(data_dir, "no class folders in train/")
    class_to_idx = {c: i for i, c in enumerate(classes)}
    unknown = [c for c in _subfolders(test_dir) if c not in class_to_idx]
    if unknown:
        raise ValueError(
            f"dataset 'imagefolder': test class folder(s) {unknown} in {os.path.abspath(test_dir)} have no train "
            f"folder in {os.path.abspath(train_dir)}; the classes are the train folders {classes}"
        )

    def listing(split_dir: str, split: str) -> tuple[list[str], np.ndarray]:
        paths: list[str] = []
        labels: list[int] = []
        for c in _subfolders(split_dir):
            images = _images_under(os.path.join(split_dir, c))
            if not images and split == "train":
                raise ValueError(
                    f"dataset 'imagefolder': train class folder {os.path.abspath(os.path.join(split_dir, c))} "
                    f"holds no image files ({', '.join(IMAGE_EXTENSIONS)})"
                )
            paths += images
            labels += [class_to_idx[c]] * len(images)
        if not paths:
            raise _not_found(data_dir, f"no image files in {split}/<class>/")
        return paths, np.asarray(labels, dtype=np.int64)

    return image_files_dataset(
        "imagefolder", listing(train_dir, "train"), listing(test_dir, "test"), len(classes), image_size
    )


__all__ = ["IMAGE_EXTENSIONS", "ImageFileDataset", "load_imagefolder"]

"""What a dataset gives the rest of wafl: train/test sets plus their labels for partitioning."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset
from wafl.common.registry import Registry


@dataclass(frozen=True)
class FederatedDataset:
    """A dataset split into a global train and a global (balanced) test set.

    ``train[i]`` and ``test[i]`` return ``(x, y)`` with ``x`` a float tensor ``(C, H, W)`` already
    normalized (and, for ``train``, augmented) and ``y`` an int. ``train_labels``/``test_labels``
    are the labels as an int64 array, used by the partitioners without touching the images.
    """

    name: str
    train: Dataset[Any]
    test: Dataset[Any]
    train_labels: np.ndarray
    test_labels: np.ndarray
    num_classes: int
    in_channels: int
    image_size: int


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not in the folder searched; the message names both and the files expected."""


def not_found(
    dataset: str,
    folder: str,
    expected: str,
    how: str,
    data_dir: str | None,
    problem: str | None = None,
    into: str = "root",
) -> DatasetNotFoundError:
    """The error for a dataset whose files are not there: it names the dataset, the folder searched,
    the files expected and how to get them. ``how`` ends with "into" and is completed with the
    data folder (``into="root"``) or its dataset sub-folder (``into="folder"``)."""
    if data_dir is None:
        target = "DATA_DIR" if into == "root" else f"DATA_DIR/{folder}/"
        return DatasetNotFoundError(
            f"dataset {dataset!r} is read from a local folder and --data-dir is required: expected "
            f"{expected} in DATA_DIR/{folder}/. To obtain them, {how} {target}."
        )
    root = os.path.abspath(data_dir)
    searched = os.path.join(root, folder)
    target = root if into == "root" else searched + "/"
    return DatasetNotFoundError(
        f"dataset {dataset!r}: {problem or 'missing files'} in {searched} (expected files: {expected}). To "
        f"obtain them, {how} {target}."
    )


# name -> loader(data_dir) -> FederatedDataset; each loader's file registers it (@DATASETS.register)
DATASETS: Registry[Callable[[str | None], FederatedDataset]] = Registry("dataset", "wafl.common.datasets")

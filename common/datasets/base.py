"""What a dataset gives the rest of wafl: train/test sets plus their labels for partitioning."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset


@dataclass(frozen=True)
class FederatedDataset:
    """A dataset split into a global train and a global (balanced) test set.

    ``train[i]`` and ``test[i]`` return ``(x, y)`` with ``x`` a float tensor ``(C, H, W)`` already
    normalized (and, for ``train``, augmented) and ``y`` an int. ``train_labels``/``test_labels``
    are the labels as an int64 array, used by the partitioners without touching the images.
    """

    name: str
    train: Dataset
    test: Dataset
    train_labels: np.ndarray
    test_labels: np.ndarray
    num_classes: int
    in_channels: int
    image_size: int


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not in the folder searched; the message names both and the files expected."""

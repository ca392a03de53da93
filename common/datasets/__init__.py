"""Dataset registry. ``digits`` is embedded; the others load from a local folder (``--data-dir``;
``fashion-mnist`` defaults to where Debian's ``dataset-fashion-mnist`` package installs it)."""

from __future__ import annotations

from collections.abc import Callable

from wafl.common.datasets.base import DatasetNotFoundError, FederatedDataset
from wafl.common.datasets.cifar import load_cifar10, load_cifar100
from wafl.common.datasets.digits import load_digits_dataset
from wafl.common.datasets.idx import load_fashion_mnist, load_mnist_idx
from wafl.common.datasets.imagefolder import load_imagefolder
from wafl.common.datasets.svhn import load_svhn
from wafl.common.datasets.synthetic import LOADERS as SYNTHETIC
from wafl.common.datasets.tinyimagenet import load_tinyimagenet

# name -> loader(data_dir) -> FederatedDataset
DATASETS: dict[str, Callable[[str | None], FederatedDataset]] = {
    "digits": load_digits_dataset,
    "fashion-mnist": load_fashion_mnist,
    "mnist-idx": load_mnist_idx,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "svhn": load_svhn,
    "tinyimagenet": load_tinyimagenet,
    "imagefolder": load_imagefolder,
    **SYNTHETIC,
}


def load_dataset(name: str, data_dir: str | None = None) -> FederatedDataset:
    """Loads a registered dataset; an unknown name raises ``ValueError`` listing the known ones."""
    try:
        loader = DATASETS[name]
    except KeyError:
        raise ValueError(f"dataset={name!r} is not one of {sorted(DATASETS)}") from None
    return loader(data_dir)


__all__ = ["DATASETS", "DatasetNotFoundError", "FederatedDataset", "load_dataset"]

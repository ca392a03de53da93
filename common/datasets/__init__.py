"""Dataset registry. ``digits`` is embedded; the others load from a local folder (``--data-dir``;
``fashion-mnist`` defaults to where Debian's ``dataset-fashion-mnist`` package installs it). A new dataset is
one file in this package whose loader carries ``@DATASETS.register("name")`` (:mod:`wafl.common.registry`)."""

from __future__ import annotations

from wafl.common.datasets.base import DATASETS, DatasetNotFoundError, FederatedDataset


def load_dataset(name: str, data_dir: str | None = None) -> FederatedDataset:
    """Loads a registered dataset; an unknown name raises ``ValueError`` listing the known ones."""
    return DATASETS.lookup(name)(data_dir)


__all__ = ["DATASETS", "DatasetNotFoundError", "FederatedDataset", "load_dataset"]

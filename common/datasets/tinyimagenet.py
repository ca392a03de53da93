"""Tiny ImageNet (200 classes, 64x64 RGB); its labelled ``val`` split is the test set.

Layout under ``data_dir`` (what extracting ``tiny-imagenet-200.zip`` gives)::

    tiny-imagenet-200/wnids.txt                        one WordNet id per line, the classes
    tiny-imagenet-200/train/<wnid>/images/*.JPEG       500 per class
    tiny-imagenet-200/val/images/*.JPEG                10000 images
    tiny-imagenet-200/val/val_annotations.txt          "<file>\t<wnid>\t<x0>\t<y0>\t<x1>\t<y1>"

Label = position of the wnid in the sorted wnid list (the order ``ImageFolder`` gives on
``train/``). Images are listed, not decoded, when loading; each is read (and converted to RGB:
a few are greyscale) when fetched.
"""

from __future__ import annotations

import os

import numpy as np
from wafl.common.datasets.base import DATASETS, DatasetNotFoundError, FederatedDataset, not_found
from wafl.common.datasets.imagefolder import image_files_dataset

URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
FOLDER = "tiny-imagenet-200"
IMAGE_SIZE = 64
EXPECTED = ["wnids.txt", "train/<wnid>/images/*.JPEG", "val/images/*.JPEG", "val/val_annotations.txt"]


def _not_found(data_dir: str | None, missing: list[str] | None = None) -> DatasetNotFoundError:
    shown = missing or EXPECTED
    more = f" (and {len(shown) - 5} more)" if len(shown) > 5 else ""
    return not_found(
        "tinyimagenet",
        FOLDER,
        ", ".join(EXPECTED),
        f"download {URL} and extract it into",
        data_dir,
        f"missing {', '.join(shown[:5])}{more}",
    )


def _jpegs(folder: str) -> list[str]:
    return sorted(e.name for e in os.scandir(folder) if e.is_file() and e.name.lower().endswith((".jpeg", ".jpg")))


@DATASETS.register("tinyimagenet")
def load_tinyimagenet(data_dir: str | None) -> FederatedDataset:
    """Tiny ImageNet: 100000 train, 10000 test (the val split), 200 classes, 64x64 RGB."""
    if data_dir is None:
        raise _not_found(None)
    root = os.path.join(data_dir, FOLDER)
    wnids_file = os.path.join(root, "wnids.txt")
    annotations_file = os.path.join(root, "val", "val_annotations.txt")
    val_images = os.path.join(root, "val", "images")
    missing = [
        rel
        for rel, ok in (
            ("wnids.txt", os.path.isfile(wnids_file)),
            ("train/", os.path.isdir(os.path.join(root, "train"))),
            ("val/images/", os.path.isdir(val_images)),
            ("val/val_annotations.txt", os.path.isfile(annotations_file)),
        )
        if not ok
    ]
    if missing:
        raise _not_found(data_dir, missing)

    with open(wnids_file) as f:
        wnids = sorted({line.strip() for line in f if line.strip()})
    if not wnids:
        raise ValueError(f"dataset 'tinyimagenet': {os.path.abspath(wnids_file)} lists no classes")
    class_to_idx = {w: i for i, w in enumerate(wnids)}

    missing = [f"train/{w}/images/" for w in wnids if not os.path.isdir(os.path.join(root, "train", w, "images"))]
    if missing:
        raise _not_found(data_dir, missing)
    train_paths: list[str] = []
    train_labels: list[int] = []
    for w in wnids:
        folder = os.path.join(root, "train", w, "images")
        names = _jpegs(folder)
        if not names:
            raise _not_found(data_dir, [f"train/{w}/images/*.JPEG"])
        train_paths += [os.path.join(folder, n) for n in names]
        train_labels += [class_to_idx[w]] * len(names)

    present = set(_jpegs(val_images))
    test_paths: list[str] = []
    test_labels: list[int] = []
    absent: list[str] = []
    with open(annotations_file) as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < 2:
                raise ValueError(f"{os.path.abspath(annotations_file)}:{number}: expected '<file> <wnid> ...'")
            name, wnid = fields[0], fields[1]
            if wnid not in class_to_idx:
                raise ValueError(
                    f"{os.path.abspath(annotations_file)}:{number}: wnid {wnid!r} is not listed in "
                    f"{os.path.abspath(wnids_file)}"
                )
            if name not in present:
                absent.append(f"val/images/{name}")
                continue
            test_paths.append(os.path.join(val_images, name))
            test_labels.append(class_to_idx[wnid])
    if absent:
        raise _not_found(data_dir, absent)
    if not test_paths:
        raise _not_found(data_dir, ["val/images/*.JPEG listed in val/val_annotations.txt"])

    train = (train_paths, np.asarray(train_labels, dtype=np.int64))
    test = (test_paths, np.asarray(test_labels, dtype=np.int64))
    return image_files_dataset("tinyimagenet", train, test, len(wnids), IMAGE_SIZE)


__all__ = ["load_tinyimagenet"]

"""MNIST-format (IDX) datasets: Fashion-MNIST, and any folder of MNIST-style IDX files.

An IDX file is a big-endian header, then the array: magic ``0x00000803`` (unsigned bytes, three
dimensions) for images, ``N x H x W``, and ``0x00000801`` (one dimension) for labels, ``N``.
Files are read as published (gzipped, ``.gz``) or uncompressed. Every problem (a missing file,
a wrong magic number, a count or shape that disagrees, a truncated or broken gzip stream) is a
:class:`DatasetNotFoundError` whose one-line message names the file and the fix.

* ``fashion-mnist``: the four files of Zalando's Fashion-MNIST (60,000 train and 10,000 test
  28x28 grey images, 10 classes) from ``--data-dir``, else from where Debian's
  ``dataset-fashion-mnist`` package puts them (``/usr/share/datasets/fashion-mnist``).
* ``mnist-idx``: any folder holding one ``*train-images*idx3*``, ``*train-labels*idx1*``,
  ``*t10k-images*idx3*`` (or ``*test-images*``) and ``*t10k-labels*idx1*`` (or ``*test-labels*``)
  file, such as MNIST, KMNIST or EMNIST. The classes are the distinct training labels; when those
  are not ``0..K-1`` (EMNIST letters are labelled 1..26) they are renumbered in sorted order.

Pixels are scaled to ``[0, 1]`` as float32 and kept as one tensor per split, which the trainer
slices directly; no augmentation.
"""

from __future__ import annotations

import fnmatch
import gzip
import os
import struct
import zlib

import numpy as np
import torch
from wafl.common.datasets.base import DATASETS, DatasetNotFoundError, FederatedDataset
from wafl.common.datasets.digits import LabeledTensorDataset

IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension
GZIP_MAGIC = b"\x1f\x8b"

FASHION_DIR = "/usr/share/datasets/fashion-mnist"  # where Debian's dataset-fashion-mnist installs them
FASHION_URL = "https://github.com/zalandoresearch/fashion-mnist"
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
FASHION_FIX = (
    f"apt-get install dataset-fashion-mnist (Debian/Ubuntu), or put the four IDX files of {FASHION_URL} "
    "(.gz or uncompressed) in a folder and pass --data-dir DIR"
)
FASHION_COUNTS = (60000, 10000)
FASHION_CLASSES = 10
# the patterns of mnist-idx: role -> alternative shell patterns (case-insensitive)
IDX_PATTERNS = {
    "train_images": ("*train-images*idx3*",),
    "train_labels": ("*train-labels*idx1*",),
    "test_images": ("*t10k-images*idx3*", "*test-images*idx3*"),
    "test_labels": ("*t10k-labels*idx1*", "*test-labels*idx1*"),
}
IDX_FIX = (
    "pass --data-dir DIR with one train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
    "t10k-labels-idx1-ubyte file (.gz or uncompressed; prefixes such as emnist-letters- are fine)"
)


def _bad(path: str, problem: str, fix: str) -> DatasetNotFoundError:
    return DatasetNotFoundError(f"{path}: {problem}. Fix: {fix}")


def _read_bytes(path: str, fix: str) -> bytes:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise _bad(path, "missing", fix) from None
    except OSError as e:
        raise _bad(path, f"unreadable ({e.strerror or e})", fix) from None
    if raw[:2] != GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise _bad(path, f"not a valid gzip file ({e})", fix) from None


def read_idx(path: str, magic: int, fix: str) -> np.ndarray:
    """The uint8 array of an IDX file with this ``magic`` (images ``(N, H, W)``, labels ``(N,)``)."""
    data = _read_bytes(path, fix)
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise _bad(path, f"only {len(data)} bytes, shorter than an IDX header", fix)
    found = struct.unpack(">I", data[:4])[0]
    if found != magic:
        raise _bad(path, f"magic number 0x{found:08x}, expected 0x{magic:08x}", fix)
    dims = struct.unpack(f">{ndim}I", data[4:header])
    size = int(np.prod(dims, dtype=np.int64))
    if len(data) - header != size:
        raise _bad(path, f"{len(data) - header} data bytes, the header's shape {dims} needs {size}", fix)
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _read_split(images_path: str, labels_path: str, fix: str) -> tuple[np.ndarray, np.ndarray]:
    images = read_idx(images_path, IMAGES_MAGIC, fix)
    labels = read_idx(labels_path, LABELS_MAGIC, fix)
    if len(images) != len(labels):
        raise _bad(images_path, f"{len(images)} images but {len(labels)} labels in {labels_path}", fix)
    if images.shape[1] != images.shape[2]:
        raise _bad(images_path, f"images of {images.shape[1]}x{images.shape[2]}, expected square ones", fix)
    return images, labels.astype(np.int64)


def _tensor_set(images: np.ndarray, labels: np.ndarray) -> LabeledTensorDataset:
    x = images.astype(np.float32)
    x /= 255.0  # in place: one float copy of the split at a time
    return LabeledTensorDataset(torch.from_numpy(x).unsqueeze(1), torch.from_numpy(labels))  # (N, 1, H, W) in [0, 1]


def _dataset(
    name: str,
    paths: dict[str, str],
    fix: str,
    counts: tuple[int, int] | None,
    size: int | None,
    num_classes: int | None,
) -> FederatedDataset:
    """Reads and checks the four files; ``counts``, ``size`` and ``num_classes`` are checked when given."""
    for path in paths.values():  # every file is there before any is read
        if not os.path.isfile(path):
            raise _bad(path, "missing", fix)
    train_x, train_y = _read_split(paths["train_images"], paths["train_labels"], fix)
    test_x, test_y = _read_split(paths["test_images"], paths["test_labels"], fix)
    for split, path, x, n in (("train", paths["train_images"], train_x, 0), ("test", paths["test_images"], test_x, 1)):
        if counts is not None and len(x) != counts[n]:
            raise _bad(path, f"{len(x)} {split} images, expected {counts[n]}", fix)
        if size is not None and x.shape[1:] != (size, size):
            raise _bad(path, f"images of {x.shape[1]}x{x.shape[2]}, expected {size}x{size}", fix)
    if test_x.shape[1:] != train_x.shape[1:]:
        raise _bad(
            paths["test_images"], f"images of {test_x.shape[1:]}, the training images are {train_x.shape[1:]}", fix
        )
    if num_classes is not None:  # a known label set: every label must lie in it
        for path, y in ((paths["train_labels"], train_y), (paths["test_labels"], test_y)):
            if len(y) and (y.min() < 0 or y.max() >= num_classes):
                raise _bad(path, f"labels {y.min()}..{y.max()} outside 0..{num_classes - 1}", fix)
    else:  # the distinct training labels, renumbered 0..K-1 in sorted order when they are not already
        classes = np.unique(train_y)
        unknown = np.setdiff1d(np.unique(test_y), classes)
        if len(unknown):
            raise _bad(paths["test_labels"], f"test label {int(unknown[0])} never occurs in the training labels", fix)
        num_classes = len(classes)
        train_y, test_y = np.searchsorted(classes, train_y), np.searchsorted(classes, test_y)
    return FederatedDataset(
        name=name,
        train=_tensor_set(train_x, train_y),
        test=_tensor_set(test_x, test_y),
        train_labels=train_y,
        test_labels=test_y,
        num_classes=num_classes,
        in_channels=1,
        image_size=int(train_x.shape[1]),
    )


def _fashion_path(folder: str, name: str) -> str:
    """``name`` in ``folder``, or its uncompressed form when only that is there."""
    path = os.path.join(folder, name)
    plain = path.removesuffix(".gz")
    return plain if not os.path.exists(path) and os.path.exists(plain) else path


@DATASETS.register("fashion-mnist")
def load_fashion_mnist(data_dir: str | None) -> FederatedDataset:
    """Fashion-MNIST: 60,000 train and 10,000 test 28x28 grey images of 10 classes (6,000 and 1,000 each)."""
    folder = os.path.abspath(data_dir or FASHION_DIR)
    paths = {role: _fashion_path(folder, f) for role, f in FASHION_FILES.items()}
    return _dataset("fashion-mnist", paths, FASHION_FIX, FASHION_COUNTS, 28, FASHION_CLASSES)


def _find(folder: str, role: str) -> str:
    names = sorted(os.listdir(folder))
    hits = [n for n in names if any(fnmatch.fnmatch(n.lower(), p) for p in IDX_PATTERNS[role])]
    if len(hits) == 1:
        return os.path.join(folder, hits[0])
    wanted = " or ".join(IDX_PATTERNS[role])
    problem = f"no file matching {wanted}" if not hits else f"{len(hits)} files match {wanted}: {', '.join(hits)}"
    raise _bad(folder, problem, IDX_FIX)


@DATASETS.register("mnist-idx")
def load_mnist_idx(data_dir: str | None) -> FederatedDataset:
    """Any MNIST-format folder (MNIST, KMNIST, EMNIST, ...): the four IDX files, classes from the labels."""
    if data_dir is None:
        raise DatasetNotFoundError(f"dataset 'mnist-idx' is read from a folder of IDX files: {IDX_FIX}")
    folder = os.path.abspath(data_dir)
    if not os.path.isdir(folder):
        raise _bad(folder, "not a folder", IDX_FIX)
    paths = {role: _find(folder, role) for role in IDX_PATTERNS}
    return _dataset("mnist-idx", paths, IDX_FIX, None, None, None)


__all__ = ["FASHION_DIR", "FASHION_FILES", "load_fashion_mnist", "load_mnist_idx", "read_idx"]

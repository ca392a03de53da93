"""Fashion-MNIST from the real IDX files, the IDX checks on bad files, and the generic mnist-idx loader.

The real files are where Debian's dataset-fashion-mnist package puts them; ``make test`` installs
the package when they are missing (scripts/datasets.sh), so these tests never skip.
"""

from __future__ import annotations

import gzip
import hashlib
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from wafl.common.datasets import DatasetNotFoundError, load_dataset
from wafl.common.datasets.idx import FASHION_DIR, FASHION_FILES, IMAGES_MAGIC, LABELS_MAGIC, read_idx

# sha256 of the 784 bytes of training image 0 (an ankle boot, label 9) and of test image 0 (label 9)
TRAIN_0_SHA256 = "5bd44e331a6d6998daf675700cd0c13dcd7af8ab954b7585124124da61459e7b"
TEST_0_SHA256 = "ffc7351ed0f8bae542820866086177fa4e0b366b97bf9d998dffdb8dbe138787"


@pytest.fixture(scope="module")
def fmnist():
    return load_dataset("fashion-mnist")


def test_counts_shapes_and_classes(fmnist):
    assert (fmnist.num_classes, fmnist.in_channels, fmnist.image_size) == (10, 1, 28)
    assert fmnist.train.tensors[0].shape == (60000, 1, 28, 28)
    assert fmnist.test.tensors[0].shape == (10000, 1, 28, 28)
    assert np.bincount(fmnist.train_labels).tolist() == [6000] * 10
    assert np.bincount(fmnist.test_labels).tolist() == [1000] * 10
    # the labels the partitioners read are the labels the trainer sees
    assert np.array_equal(fmnist.train.tensors[1].numpy(), fmnist.train_labels)
    assert np.array_equal(fmnist.test.tensors[1].numpy(), fmnist.test_labels)


def test_pixels_are_bytes_scaled_to_unit_range(fmnist):
    x = fmnist.train.tensors[0]
    assert x.dtype == torch.float32
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    raw = read_idx(str(Path(FASHION_DIR) / FASHION_FILES["train_images"]), IMAGES_MAGIC, "")
    assert torch.equal(x[:100, 0], torch.from_numpy(raw[:100].astype(np.float32) / 255.0))


def test_known_images(fmnist):
    for role, digest, label in (("train", TRAIN_0_SHA256, 9), ("test", TEST_0_SHA256, 9)):
        split = fmnist.train if role == "train" else fmnist.test
        x, y = split[0]
        image = torch.round(x[0] * 255).to(torch.uint8).numpy()
        assert hashlib.sha256(image.tobytes()).hexdigest() == digest
        assert int(y) == label


# ---------------------------------------------------------------------------------------------
# IDX files written here: good, missing, corrupt.


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    return struct.pack(f">I{array.ndim}I", magic, *array.shape) + array.astype(np.uint8).tobytes()


def write_idx_folder(folder: Path, names: dict[str, str], train: int, test: int, labels: list[int], seed: int = 0):
    """Four IDX files (gzipped when the name ends in .gz); returns the arrays written."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train_images": rng.integers(0, 256, size=(train, 28, 28)),
        "train_labels": rng.choice(labels, size=train),
        "test_images": rng.integers(0, 256, size=(test, 28, 28)),
        "test_labels": rng.choice(labels, size=test),
    }
    for role, name in names.items():
        data = idx_bytes(arrays[role], IMAGES_MAGIC if "images" in role else LABELS_MAGIC)
        (folder / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return arrays


def copy_fashion(dst: Path) -> Path:
    dst.mkdir()
    for name in FASHION_FILES.values():
        shutil.copy(Path(FASHION_DIR) / name, dst / name)
    return dst


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_file_names_it_and_the_fix(tmp_path):
    folder = copy_fashion(tmp_path / "f")
    (folder / FASHION_FILES["test_labels"]).unlink()
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("fashion-mnist", str(folder))
    message = one_line(err)
    assert str(folder / FASHION_FILES["test_labels"]) in message and "missing" in message
    assert "apt-get install dataset-fashion-mnist" in message and "--data-dir" in message


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda raw: raw[: len(raw) // 2], "not a valid gzip file"),  # truncated download
        (lambda raw: b"\x1f\x8b" + b"\x00" * 64, "not a valid gzip file"),
        # uncompressed (the reader goes by the content, not the name), which is quicker to write
        (lambda raw: struct.pack(">I", 0x00000801) + gzip.decompress(raw)[4:], "magic number"),
        (lambda raw: gzip.decompress(raw)[:-784], "data bytes"),
    ],
)
def test_corrupt_file_names_it(tmp_path, damage, problem):
    folder = copy_fashion(tmp_path / "f")
    bad = folder / FASHION_FILES["train_images"]
    bad.write_bytes(damage(bad.read_bytes()))
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("fashion-mnist", str(folder))
    message = one_line(err)
    assert message.startswith(f"{bad}: ") and problem in message and "apt-get install" in message


def test_wrong_counts_shape_and_labels_are_refused(tmp_path):
    names = dict(FASHION_FILES)
    write_idx_folder(tmp_path / "a", names, 12, 4, list(range(10)))
    with pytest.raises(DatasetNotFoundError, match="12 train images, expected 60000"):
        load_dataset("fashion-mnist", str(tmp_path / "a"))
    # images and labels of different lengths
    folder = tmp_path / "b"
    write_idx_folder(folder, names, 12, 4, list(range(10)))
    (folder / names["train_labels"]).write_bytes(gzip.compress(idx_bytes(np.zeros(11), LABELS_MAGIC)))
    with pytest.raises(DatasetNotFoundError, match="12 images but 11 labels"):
        load_dataset("fashion-mnist", str(folder))


def test_uncompressed_files_are_read(tmp_path):
    plain = {role: name.removesuffix(".gz") for role, name in FASHION_FILES.items()}
    folder = tmp_path / "raw"
    folder.mkdir()
    for role, name in plain.items():
        (folder / name).write_bytes(gzip.decompress((Path(FASHION_DIR) / FASHION_FILES[role]).read_bytes()))
    ds = load_dataset("fashion-mnist", str(folder))
    assert len(ds.train_labels) == 60000 and np.bincount(ds.test_labels).tolist() == [1000] * 10


def test_cli_prints_one_line_naming_the_file(tmp_path):
    folder = copy_fashion(tmp_path / "f")
    (folder / FASHION_FILES["train_images"]).write_bytes(b"not an idx file, not at all")
    proc = subprocess.run(
        [sys.executable, "-m", "wafl.cli.main", "run", "--dataset", "fashion-mnist", "--data-dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(folder / FASHION_FILES["train_images"]) in lines[0], proc.stderr
    assert "magic number" in lines[0] and "apt-get install dataset-fashion-mnist" in lines[0]


# ---------------------------------------------------------------------------------------------
# mnist-idx: any MNIST-format folder.


def test_mnist_idx_reads_any_prefix_and_renumbers_labels(tmp_path):
    names = {
        "train_images": "emnist-letters-train-images-idx3-ubyte.gz",
        "train_labels": "emnist-letters-train-labels-idx1-ubyte.gz",
        "test_images": "emnist-letters-test-images-idx3-ubyte",
        "test_labels": "emnist-letters-test-labels-idx1-ubyte",
    }
    arrays = write_idx_folder(tmp_path, names, 30, 8, [1, 2, 5, 26])  # letters are labelled from 1
    ds = load_dataset("mnist-idx", str(tmp_path))
    assert ds.num_classes == 4 and ds.image_size == 28 and ds.in_channels == 1
    rank = {1: 0, 2: 1, 5: 2, 26: 3}
    assert ds.train_labels.tolist() == [rank[int(v)] for v in arrays["train_labels"]]
    assert ds.test.tensors[1].tolist() == [rank[int(v)] for v in arrays["test_labels"]]
    assert torch.equal(ds.test.tensors[0][:, 0], torch.from_numpy(arrays["test_images"].astype(np.float32) / 255))


def test_mnist_idx_reads_the_fashion_files_like_fashion_mnist(fmnist):
    ds = load_dataset("mnist-idx", FASHION_DIR)
    assert ds.num_classes == 10
    assert torch.equal(ds.train.tensors[0], fmnist.train.tensors[0])
    assert np.array_equal(ds.test_labels, fmnist.test_labels)


def test_mnist_idx_errors(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="--data-dir"):
        load_dataset("mnist-idx", None)
    names = {
        "train_images": "train-images-idx3-ubyte",
        "train_labels": "train-labels-idx1-ubyte",
        "test_images": "t10k-images-idx3-ubyte",
        "test_labels": "t10k-labels-idx1-ubyte",
    }
    write_idx_folder(tmp_path, names, 6, 3, [0, 1])
    (tmp_path / names["test_labels"]).unlink()
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("mnist-idx", str(tmp_path))
    assert str(tmp_path) in one_line(err) and "t10k-labels" in str(err.value)
    (tmp_path / "test-labels-idx1-ubyte").write_bytes(idx_bytes(np.array([0, 1, 7]), LABELS_MAGIC))
    with pytest.raises(DatasetNotFoundError, match="test label 7 never occurs"):
        load_dataset("mnist-idx", str(tmp_path))


def test_setup_script_is_quiet_when_nothing_is_needed(repo):
    for args in (["--rounds", "3"], ["--dataset", "fashion-mnist", "--data-dir", "/elsewhere"], ["fashion-mnist"]):
        proc = subprocess.run(["bash", "scripts/datasets.sh", *args], cwd=repo, capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stderr == "", (args, proc.stderr)

"""The file-backed datasets, loaded from small files written here in each real on-disk format."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from wafl.common.datasets import DATASETS, DatasetNotFoundError, load_dataset
from wafl.common.datasets.imagefolder import load_imagefolder
from wafl.common.datasets.transforms import NORMALIZATION

FILE_DATASETS = ["cifar10", "cifar100", "svhn", "tinyimagenet", "imagefolder"]


# ---------------------------------------------------------------------------------------------
# Writers of each format, at toy scale.


def _cifar_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """``(n, 3072)`` uint8 rows: the red, green then blue 32x32 planes, as in the CIFAR batches."""
    return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)


def _dump(path, obj) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar10(data_dir, per_batch: int = 3, test_size: int = 4, seed: int = 0):
    """Returns ``(train_rows, train_labels, test_rows, test_labels)`` in file order."""
    rng = np.random.default_rng(seed)
    folder = data_dir / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    train_rows, train_labels = [], []
    for b in range(1, 6):
        rows = _cifar_rows(rng, per_batch)
        labels = rng.integers(0, 10, size=per_batch).tolist()
        _dump(
            folder / f"data_batch_{b}",
            {
                b"batch_label": f"training batch {b} of 5".encode(),
                b"labels": labels,
                b"data": rows,
                b"filenames": [f"img_{b}_{i}.png".encode() for i in range(per_batch)],
            },
        )
        train_rows.append(rows)
        train_labels += labels
    test_rows = _cifar_rows(rng, test_size)
    test_labels = [9, 0, 3, 7][:test_size]
    _dump(
        folder / "test_batch",
        {
            b"batch_label": b"testing batch 1 of 1",
            b"labels": test_labels,
            b"data": test_rows,
            b"filenames": [f"test_{i}.png".encode() for i in range(test_size)],
        },
    )
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    _dump(folder / "batches.meta", {b"num_cases_per_batch": per_batch, b"label_names": names, b"num_vis": 3072})
    return np.concatenate(train_rows), np.array(train_labels), test_rows, np.array(test_labels)


def write_cifar100(data_dir, train_size: int = 6, test_size: int = 4, seed: int = 1):
    rng = np.random.default_rng(seed)
    folder = data_dir / "cifar-100-python"
    folder.mkdir(parents=True)
    out = []
    train_fine, test_fine = [0, 99, 42, 5, 99, 17][:train_size], [99, 1, 50, 0][:test_size]
    splits = (("train", train_size, train_fine), ("test", test_size, test_fine))
    for split, n, fine in splits:
        rows = _cifar_rows(rng, n)
        _dump(
            folder / split,
            {
                b"filenames": [f"{split}_{i}.png".encode() for i in range(n)],
                b"batch_label": f"{split}ing batch 1 of 1".encode(),
                b"fine_labels": fine,
                b"coarse_labels": [f // 5 for f in fine],
                b"data": rows,
            },
        )
        out += [rows, np.array(fine)]
    _dump(
        folder / "meta",
        {
            b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
            b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
        },
    )
    return tuple(out)


def write_svhn(data_dir, train_size: int = 5, test_size: int = 4, seed: int = 2):
    """``X`` ``(32, 32, 3, N)`` uint8 and ``y`` ``(N, 1)`` uint8 with 10 standing for the digit 0."""
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    folder = data_dir / "svhn"
    folder.mkdir(parents=True)
    out = []
    for fname, n, y in (
        ("train_32x32.mat", train_size, [10, 1, 9, 10, 5][:train_size]),
        ("test_32x32.mat", test_size, [3, 10, 2, 10][:test_size]),
    ):
        x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
        savemat(folder / fname, {"X": x, "y": np.array(y, dtype=np.uint8).reshape(n, 1)})
        out += [x, np.array(y)]
    return tuple(out)


def _random_rgb(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    # Blocky images survive JPEG well; exactness is checked against the decoded file anyway.
    small = rng.integers(0, 256, size=(max(1, h // 8), max(1, w // 8), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.NEAREST)


# Listed unsorted as in the real wnids.txt; labels follow the sorted order.
TINY_WNIDS = ["n09999999", "n01443537", "n04067472"]


def write_tinyimagenet(data_dir, per_class: int = 2, seed: int = 3):
    """Returns ``{train|val image path: wnid}`` of what was written."""
    rng = np.random.default_rng(seed)
    root = data_dir / "tiny-imagenet-200"
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(TINY_WNIDS) + "\n")
    (root / "words.txt").write_text("".join(f"{w}\tthing {w}\n" for w in TINY_WNIDS))
    written = {}
    for w in TINY_WNIDS:
        images = root / "train" / w / "images"
        images.mkdir(parents=True)
        boxes = []
        for k in range(per_class):
            path = images / f"{w}_{k}.JPEG"
            _random_rgb(rng, 64, 64).save(path, "JPEG")
            written[path] = w
            boxes.append(f"{w}_{k}.JPEG\t0\t0\t63\t63\n")
        (root / "train" / w / f"{w}_boxes.txt").write_text("".join(boxes))
    lines = []
    for k, w in enumerate(["n04067472", "n01443537", "n09999999", "n01443537"]):
        path = root / "val" / "images" / f"val_{k}.JPEG"
        img = _random_rgb(rng, 64, 64)
        if k == 1:
            img = img.convert("L")  # the real set has a few greyscale images
        img.save(path, "JPEG")
        written[path] = w
        lines.append(f"val_{k}.JPEG\t{w}\t{k}\t{k + 1}\t{40 + k}\t{50 + k}\n")
    (root / "val" / "val_annotations.txt").write_text("".join(lines))
    return written


def write_imagefolder(data_dir, seed: int = 4):
    """Three classes; train images of mixed sizes, test images 64x64 plus one wide one."""
    rng = np.random.default_rng(seed)
    root = data_dir / "imagefolder"
    sizes = {"train": [(64, 64), (80, 96), (50, 40)], "test": [(64, 64)]}
    for split, counts in (("train", {"dog": 3, "ant": 2, "cat": 2}), ("test", {"cat": 2, "ant": 1})):
        for cls, n in counts.items():
            folder = root / split / cls
            folder.mkdir(parents=True)
            for k in range(n):
                h, w = sizes[split][k % len(sizes[split])]
                _random_rgb(rng, h, w).save(folder / f"{cls}_{k}.jpg", "JPEG")
            (folder / "notes.txt").write_text("not an image")
    _random_rgb(rng, 64, 128).save(root / "test" / "ant" / "wide.png")  # 128 wide, 64 high
    return root


# ---------------------------------------------------------------------------------------------
# Checks shared by the datasets.


def unnormalize(x: torch.Tensor, name: str) -> np.ndarray:
    mean, std = NORMALIZATION[name]
    return (x * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)).numpy()


def chw01(rows_or_hwc: np.ndarray) -> np.ndarray:
    """The expected ``(3, H, W)`` pixels in [0, 1] of an ``(H, W, 3)`` uint8 image."""
    return rows_or_hwc.transpose(2, 0, 1).astype(np.float64) / 255.0


def cifar_row_chw01(row: np.ndarray) -> np.ndarray:
    return row.reshape(3, 32, 32).astype(np.float64) / 255.0


def decoded_chw01(path) -> np.ndarray:
    with Image.open(path) as img:
        return chw01(np.asarray(img.convert("RGB")))


def match_augmentation(sample: np.ndarray, original: np.ndarray, pad: int, allow_flip: bool):
    """``(top, left, flipped)`` of the zero-padded crop (then flip) that gives ``sample``, or None."""
    h, w = original.shape[1:]
    padded = np.pad(original, ((0, 0), (pad, pad), (pad, pad)))
    for flipped in (False, True) if allow_flip else (False,):
        for top in range(2 * pad + 1):
            for left in range(2 * pad + 1):
                crop = padded[:, top : top + h, left : left + w]
                if flipped:
                    crop = crop[:, :, ::-1]
                if np.allclose(sample, crop, atol=1e-5):
                    return top, left, flipped
    return None


def check_common(ds, name: str, num_classes: int, n_train: int, n_test: int, size: int) -> None:
    assert ds.name == name
    assert (ds.num_classes, ds.in_channels, ds.image_size) == (num_classes, 3, size)
    assert len(ds.train) == n_train and len(ds.test) == n_test
    for labels, split in ((ds.train_labels, ds.train), (ds.test_labels, ds.test)):
        assert isinstance(labels, np.ndarray) and labels.dtype == np.int64 and labels.shape == (len(split),)
        assert labels.min() >= 0 and labels.max() < num_classes
    for split in (ds.train, ds.test):
        for i in (0, len(split) - 1):
            x, y = split[i]
            assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.shape == (3, size, size)
            assert type(y) is int


# ---------------------------------------------------------------------------------------------
# CIFAR.


def test_registry_has_file_datasets():
    assert set(FILE_DATASETS) <= set(DATASETS)


def test_cifar10_loads_pickle_batches(tmp_path):
    train_rows, train_y, test_rows, test_y = write_cifar10(tmp_path)
    ds = load_dataset("cifar10", str(tmp_path))
    check_common(ds, "cifar10", 10, 15, 4, 32)
    np.testing.assert_array_equal(ds.train_labels, train_y)  # data_batch_1..5 in order
    np.testing.assert_array_equal(ds.test_labels, test_y)
    for i in range(len(test_y)):
        x, y = ds.test[i]
        assert y == test_y[i]
        np.testing.assert_allclose(unnormalize(x, "cifar10"), cifar_row_chw01(test_rows[i]), atol=1e-5)
    assert ds.train[7][1] == train_y[7]


def test_cifar10_train_augmentation_is_padded_crop_and_flip(tmp_path):
    train_rows, *_ = write_cifar10(tmp_path)
    ds = load_dataset("cifar10", str(tmp_path))
    torch.manual_seed(0)
    original = cifar_row_chw01(train_rows[2])
    found = [match_augmentation(unnormalize(ds.train[2][0], "cifar10"), original, 4, True) for _ in range(16)]
    assert all(f is not None for f in found), "a train sample is not a 4-padded crop (+flip) of its image"
    assert any(f[2] for f in found) and any(not f[2] for f in found)
    assert max(max(abs(top - 4), abs(left - 4)) for top, left, _ in found) > 2  # the whole +-4 range is used


def test_cifar100_uses_fine_labels(tmp_path):
    train_rows, train_y, test_rows, test_y = write_cifar100(tmp_path)
    ds = load_dataset("cifar100", str(tmp_path))
    check_common(ds, "cifar100", 100, 6, 4, 32)
    np.testing.assert_array_equal(ds.train_labels, train_y)
    np.testing.assert_array_equal(ds.test_labels, [99, 1, 50, 0])
    for i in range(4):
        x, y = ds.test[i]
        assert y == test_y[i]
        np.testing.assert_allclose(unnormalize(x, "cifar100"), cifar_row_chw01(test_rows[i]), atol=1e-5)


def test_cifar_refuses_pickles_that_are_not_plain_data(tmp_path):
    write_cifar10(tmp_path)

    class Payload:
        def __reduce__(self):
            return (os.getcwd, ())

    _dump(tmp_path / "cifar-10-batches-py" / "test_batch", {b"data": Payload(), b"labels": []})
    with pytest.raises(pickle.UnpicklingError):
        load_dataset("cifar10", str(tmp_path))


def test_cifar_rejects_out_of_range_labels(tmp_path):
    write_cifar10(tmp_path)
    rows = _cifar_rows(np.random.default_rng(0), 1)
    _dump(tmp_path / "cifar-10-batches-py" / "test_batch", {b"data": rows, b"labels": [10]})
    with pytest.raises(ValueError, match="label 10"):
        load_dataset("cifar10", str(tmp_path))


# ---------------------------------------------------------------------------------------------
# SVHN.


def test_svhn_loads_mat_and_maps_10_to_0(tmp_path):
    train_x, train_y, test_x, test_y = write_svhn(tmp_path)
    ds = load_dataset("svhn", str(tmp_path))
    check_common(ds, "svhn", 10, 5, 4, 32)
    np.testing.assert_array_equal(ds.train_labels, [0, 1, 9, 0, 5])
    np.testing.assert_array_equal(ds.test_labels, [3, 0, 2, 0])
    for i in range(4):
        x, y = ds.test[i]
        assert y == test_y[i] % 10
        np.testing.assert_allclose(unnormalize(x, "svhn"), chw01(test_x[:, :, :, i]), atol=1e-5)


def test_svhn_augmentation_never_flips(tmp_path):
    train_x, *_ = write_svhn(tmp_path)
    ds = load_dataset("svhn", str(tmp_path))
    torch.manual_seed(0)
    original = chw01(train_x[:, :, :, 1])
    found = [match_augmentation(unnormalize(ds.train[1][0], "svhn"), original, 4, False) for _ in range(16)]
    assert all(f is not None for f in found), "an SVHN train sample is not an unflipped 4-padded crop"
    assert max(max(abs(top - 4), abs(left - 4)) for top, left, _ in found) > 2


# ---------------------------------------------------------------------------------------------
# Tiny ImageNet.


def test_tinyimagenet_train_and_val_layout(tmp_path):
    written = write_tinyimagenet(tmp_path)
    ds = load_dataset("tinyimagenet", str(tmp_path))
    check_common(ds, "tinyimagenet", 3, 6, 4, 64)
    label = {w: i for i, w in enumerate(sorted(TINY_WNIDS))}  # n01443537 -> 0, n04067472 -> 1, n09999999 -> 2
    np.testing.assert_array_equal(np.sort(ds.train_labels), [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(ds.test_labels, [1, 0, 2, 0])  # val_annotations.txt order
    for i, path in enumerate(ds.train.paths):
        assert ds.train_labels[i] == label[written[Path(path)]]
    val_dir = tmp_path / "tiny-imagenet-200" / "val" / "images"
    for i in range(4):
        x, y = ds.test[i]
        assert y == ds.test_labels[i]
        np.testing.assert_allclose(unnormalize(x, "tinyimagenet"), decoded_chw01(val_dir / f"val_{i}.JPEG"), atol=1e-5)
    torch.manual_seed(0)
    original = decoded_chw01(ds.train.paths[0])
    found = [match_augmentation(unnormalize(ds.train[0][0], "tinyimagenet"), original, 8, True) for _ in range(8)]
    assert all(f is not None for f in found), "a train sample is not an 8-padded crop (+flip) of its image"
    assert max(max(abs(top - 8), abs(left - 8)) for top, left, _ in found) > 4


def test_tinyimagenet_lists_images_without_decoding_them(tmp_path):
    write_tinyimagenet(tmp_path)
    broken = tmp_path / "tiny-imagenet-200" / "val" / "images" / "val_2.JPEG"
    broken.write_bytes(b"not a jpeg")
    ds = load_dataset("tinyimagenet", str(tmp_path))  # labels come from the listing alone
    np.testing.assert_array_equal(ds.test_labels, [1, 0, 2, 0])
    ds.test[1]
    with pytest.raises(OSError):
        ds.test[2]


def test_tinyimagenet_val_image_missing_is_reported(tmp_path):
    write_tinyimagenet(tmp_path)
    (tmp_path / "tiny-imagenet-200" / "val" / "images" / "val_3.JPEG").unlink()
    with pytest.raises(DatasetNotFoundError, match="val/images/val_3.JPEG"):
        load_dataset("tinyimagenet", str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Class folders.


def test_imagefolder_classes_and_lazy_loading(tmp_path):
    root = write_imagefolder(tmp_path)
    ds = load_dataset("imagefolder", str(tmp_path))
    check_common(ds, "imagefolder", 3, 7, 4, 64)  # notes.txt files are skipped
    np.testing.assert_array_equal(ds.train_labels, [0, 0, 1, 1, 2, 2, 2])  # ant, cat, dog
    np.testing.assert_array_equal(ds.test_labels, [0, 0, 1, 1])
    for i, path in enumerate(ds.test.paths):
        x, y = ds.test[i]
        assert y == ds.test_labels[i]
        expected = decoded_chw01(path)
        if os.path.basename(path) == "wide.png":  # shorter side already 64: only the central square is kept
            expected = expected[:, :, 32:96]
        np.testing.assert_allclose(unnormalize(x, "imagefolder"), expected, atol=1e-5)
    for i in range(len(ds.train)):  # 64x64, 80x96 and 50x40 sources all come out 64x64
        assert ds.train[i][0].shape == (3, 64, 64)
    # Nothing was read into memory: a file removed after loading is missed when fetched.
    (root / "train" / "dog" / "dog_2.jpg").unlink()
    ds.train[0]
    with pytest.raises(FileNotFoundError):
        ds.train[6]


def test_imagefolder_resize_is_configurable(tmp_path):
    write_imagefolder(tmp_path)
    ds = load_imagefolder(str(tmp_path), image_size=32)
    assert ds.image_size == 32
    assert all(ds.test[i][0].shape == (3, 32, 32) for i in range(len(ds.test)))
    assert ds.train[3][0].shape == (3, 32, 32)


def test_imagefolder_test_class_unknown_to_train_is_an_error(tmp_path):
    root = write_imagefolder(tmp_path)
    (root / "test" / "zebra").mkdir()
    _random_rgb(np.random.default_rng(0), 64, 64).save(root / "test" / "zebra" / "z.jpg")
    with pytest.raises(ValueError, match="zebra"):
        load_dataset("imagefolder", str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Missing files.

EXPECTED_IN_MESSAGE = {
    "cifar10": ("cifar-10-batches-py", ["data_batch_1", "data_batch_5", "test_batch", "cifar-10-python.tar.gz"]),
    "cifar100": ("cifar-100-python", ["train", "test", "cifar-100-python.tar.gz"]),
    "svhn": ("svhn", ["train_32x32.mat", "test_32x32.mat", "ufldl.stanford.edu"]),
    "tinyimagenet": ("tiny-imagenet-200", ["wnids.txt", "val_annotations.txt", "tiny-imagenet-200.zip"]),
    "imagefolder": ("imagefolder", ["train/<class>", "test/<class>"]),
}


@pytest.mark.parametrize("name", FILE_DATASETS)
def test_missing_files_error_names_dataset_folder_and_files(tmp_path, name):
    folder, expected = EXPECTED_IN_MESSAGE[name]
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset(name, str(tmp_path))
    message = str(info.value)
    assert repr(name) in message
    assert os.path.join(str(tmp_path), folder) in message
    for item in expected:
        assert item in message
    assert "To obtain them" in message


@pytest.mark.parametrize("name", FILE_DATASETS)
def test_no_data_dir_says_data_dir_is_required(name):
    folder, expected = EXPECTED_IN_MESSAGE[name]
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset(name, None)
    message = str(info.value)
    assert repr(name) in message and "--data-dir is required" in message
    assert folder in message and expected[0] in message


def test_partially_missing_cifar_names_the_missing_batches(tmp_path):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_5").unlink()
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(DatasetNotFoundError, match="missing data_batch_5, test_batch in "):
        load_dataset("cifar10", str(tmp_path))


def test_digits_are_scikit_learns_read_without_importing_it() -> None:
    import subprocess
    import sys

    from sklearn.datasets import load_digits
    from wafl.common.datasets.digits import read_digits

    images, target = read_digits()
    ref = load_digits()
    assert images.dtype == ref.images.dtype and np.array_equal(images, ref.images)
    assert target.dtype == ref.target.dtype and np.array_equal(target, ref.target)
    probe = (
        "import sys; "
        "from wafl.common.datasets import load_dataset; load_dataset('digits'); "
        "print('sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]

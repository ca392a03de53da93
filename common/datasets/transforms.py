"""Per-dataset normalization constants and the train/test transforms built from them.

A transform takes an RGB ``PIL.Image`` and returns a normalized float tensor ``(C, H, W)``.
Train transforms add the standard augmentation: a random crop of the same size after zero
padding of ``size // 8`` pixels (4 for 32px, 8 for 64px) and, where mirrored images are still
valid samples, a random horizontal flip (not for SVHN: a mirrored digit is not the same digit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchvision.transforms import Compose

# torchvision is imported when a transform is built, not with this module: the registry (and so
# everything that lists the dataset names) stays importable without paying for it.

# name -> (per-channel mean, per-channel std) of the training pixels scaled to [0, 1].
NORMALIZATION: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "tinyimagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
    # Arbitrary class folders (iNaturalist and the like): the ImageNet statistics.
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}

# Whether a horizontally flipped image is still a valid sample of its class.
HORIZONTAL_FLIP: dict[str, bool] = {
    "cifar10": True,
    "cifar100": True,
    "svhn": False,
    "tinyimagenet": True,
    "imagefolder": True,
}


def crop_padding(image_size: int) -> int:
    """The zero padding of the random crop: 4 pixels at 32px, 8 at 64px (an eighth of the side)."""
    return max(1, image_size // 8)


def _constants(name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    try:
        return NORMALIZATION[name]
    except KeyError:
        raise ValueError(f"no normalization constants for dataset={name!r}; known: {sorted(NORMALIZATION)}") from None


def _resize(image_size: int) -> list[Any]:
    from torchvision import transforms as T

    # Shorter side to image_size, then the central square: keeps the aspect ratio. An image
    # already image_size x image_size passes through untouched.
    return [T.Resize(image_size), T.CenterCrop(image_size)]


def train_transform(name: str, image_size: int, resize: bool = False) -> Compose:
    """Augmentation (random padded crop, horizontal flip where it fits) then normalization.

    ``resize`` first brings images of any size to ``image_size``.
    """
    from torchvision import transforms as T

    mean, std = _constants(name)
    steps = _resize(image_size) if resize else []
    steps.append(T.RandomCrop(image_size, padding=crop_padding(image_size)))
    if HORIZONTAL_FLIP.get(name, False):
        steps.append(T.RandomHorizontalFlip())
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(steps)


def eval_transform(name: str, image_size: int, resize: bool = False) -> Compose:
    """The test-split transform: normalization only (after the deterministic resize when ``resize``).

    Not named ``test_transform`` so that importing it into a test module does not make pytest
    collect it as a test.
    """
    from torchvision import transforms as T

    mean, std = _constants(name)
    steps = _resize(image_size) if resize else []
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(steps)


__all__ = ["HORIZONTAL_FLIP", "NORMALIZATION", "crop_padding", "eval_transform", "train_transform"]

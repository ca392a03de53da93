"""Small models and parameter-shaped tensors for the exact-formula tests of the regularizers and FedDyn."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn


def tiny_model(seed: int = 0) -> nn.Module:
    """A float64 MLP (3 -> 4 -> 2) with seeded weights."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()


def random_like_params(model: nn.Module, seed: int) -> list[torch.Tensor]:
    """One seeded standard-normal tensor per parameter of ``model``, of its shape and dtype."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in model.parameters()]


def flat_np(tensors: Iterable[torch.Tensor]) -> np.ndarray:
    """The tensors flattened and concatenated, as one NumPy vector."""
    return np.concatenate([t.detach().numpy().reshape(-1) for t in tensors])

"""Gradient dissimilarity across clients (the ASD paper's G_d, after FedProx and FedNTD).

``G_d(w) = mean_k ||grad f_k(w)||^2 / ||mean_k grad f_k(w)||^2`` over the clients ``k`` of a round,
each ``grad f_k`` the full gradient of client ``k``'s training objective over its whole training
set at the global model ``w``. In the paper ``f_k = L_k + lambda L_k^ASD`` with ``L_k`` the mean
cross-entropy; at the global model itself the ASD term ``KL(q_g || q_k)`` is at its minimum (the
client's predictions are the global model's), so its gradient vanishes and ``grad f_k`` is the
gradient of the cross-entropy, which is what is computed here. By Jensen's inequality ``G_d >= 1``,
with equality when every client's gradient is the same; the mean is unweighted, as in the paper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset
from wafl.common.analysis.hessian import HessianOperator
from wafl.common.training import batches

FIELD = "grad_dissimilarity"


def full_gradient(
    model: nn.Module,
    dataset: Dataset[Any],
    indices: np.ndarray,
    batch_size: int = 256,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The gradient of the mean cross-entropy of ``model`` over ``dataset[indices]`` (evaluation mode),
    flattened over the model's trainable parameters."""
    data = list(batches(dataset, indices, batch_size, False, device=device))
    was_training = model.training
    try:
        return HessianOperator(model, data).gradient()
    finally:
        model.train(was_training)


def gradient_dissimilarity(grads: Sequence[torch.Tensor]) -> dict[str, float]:
    """``G_d`` of the clients' flat gradients, with its numerator and denominator:
    ``grad_dissimilarity``, ``grad_sq_norm_mean`` (mean of ``||g_k||^2``) and ``mean_grad_sq_norm``
    (``||mean_k g_k||^2``). ``G_d`` is infinite when the mean gradient is zero and some is not."""
    if not grads:
        raise ValueError("gradient dissimilarity needs at least one client's gradient")
    g = torch.stack([t.double() for t in grads])
    num = float((g * g).sum(1).mean())
    den = float(g.mean(0).pow(2).sum())
    ratio = num / den if den > 0 else (1.0 if num == 0 else float("inf"))
    return {FIELD: ratio, "grad_sq_norm_mean": num, "mean_grad_sq_norm": den}

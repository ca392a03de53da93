"""FedHKD hyper-knowledge: per-class mean representations and soft predictions (Chen, Wang and
Vikalo, "The Best of Both Worlds: Accurate Global and Personalized Models through Federated Learning
with Data-Free Hyper-Knowledge Distillation", ICLR 2023; the method is :mod:`~wafl.common.algorithms.fedhkd`).

A client summarises its local train set, class by class, as ``(h_tilde^j, q_bar^j, N^j)``:
the mean of the clipped representations plus Gaussian noise, the mean softmax of the logits
at temperature ``T``, and the class count. The server averages these per class weighted by
the counts, and the clients add two regularisers to their cross-entropy (see
:func:`fedhkd_loss_terms`). Everything here is a pure function of tensors and modules.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from wafl.common.knowledge import ClassKnowledge, Knowledge
from wafl.common.models.base import submodule

__all__ = [
    "class_sums",
    "extract_knowledge",
    "fedhkd_loss_terms",
    "knowledge_rows",
    "stack_knowledge",
]


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def class_sums(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    num_classes: int,
    temperature: float,
    zeta: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-class ``(counts, sum of representations, sum of softmax(logits / T))`` in float64 on the CPU.

    The model runs in eval mode without gradients; its previous mode is restored. With
    ``zeta`` set, every representation element is clipped to ``[-zeta, zeta]`` before it is
    summed; the logits always come from the unclipped representation (the model's own
    prediction). Shapes: ``(C,)`` int64, ``(C, code_len)``, ``(C, C)``.
    """
    if num_classes < 1:
        raise ValueError(f"num_classes={num_classes} must be >= 1")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    device = _model_device(model)
    counts = torch.zeros(num_classes, dtype=torch.int64)
    rep_sums: Tensor | None = None
    soft_sums = torch.zeros(num_classes, num_classes, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for x, y in batches:
                y = torch.as_tensor(y).reshape(-1).to(torch.int64).cpu()
                if y.numel() == 0:
                    continue
                if int(y.min()) < 0 or int(y.max()) >= num_classes:
                    raise ValueError(
                        f"labels must lie in [0, {num_classes - 1}], got range [{int(y.min())}, {int(y.max())}]"
                    )
                h = submodule(model, "features")(x.to(device))
                h = h.reshape(h.shape[0], -1)
                logits = submodule(model, "classifier")(h)
                if logits.shape[-1] != num_classes:
                    raise ValueError(f"classifier gives {logits.shape[-1]} logits, num_classes={num_classes}")
                soft = torch.softmax(logits.double() / temperature, dim=-1).cpu()
                rep = h.double()
                if zeta is not None:
                    rep = rep.clamp(-zeta, zeta)
                rep = rep.cpu()
                if rep_sums is None:
                    rep_sums = torch.zeros(num_classes, rep.shape[1], dtype=torch.float64)
                counts += torch.bincount(y, minlength=num_classes)
                rep_sums.index_add_(0, y, rep)
                soft_sums.index_add_(0, y, soft)
    finally:
        model.train(was_training)
    if rep_sums is None:
        code_len = int(getattr(model, "code_len", 0))
        rep_sums = torch.zeros(num_classes, code_len, dtype=torch.float64)
    return counts, rep_sums, soft_sums


def extract_knowledge(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    num_classes: int,
    nu: float,
    zeta: float,
    sigma: float,
    temperature: float,
    generator: torch.Generator | None = None,
) -> Knowledge:
    """A client's (noisy) hyper-knowledge over its local train set.

    Class ``j`` is shared when ``N_j >= nu * N`` and ``N_j > 0`` (``N`` = all samples seen).
    ``rep`` = mean of the representations clipped element-wise to ``[-zeta, zeta]``, plus
    ``N(0, (sigma * 2 * zeta / N_j)^2 I)``, one independent draw per class (``sigma = 0``: no
    noise). ``soft`` = mean of ``softmax(classifier(h) / T)`` with the *unclipped* ``h``, i.e.
    the prediction the model actually makes; it carries no noise. The noise is drawn on the
    CPU from ``generator`` (must be a CPU generator) and the result lives on the CPU in float32.
    """
    if not 0.0 <= nu <= 1.0:
        raise ValueError(f"nu={nu} must lie in [0, 1]")
    if not (zeta > 0 and math.isfinite(zeta)):
        raise ValueError(f"zeta={zeta} must be a finite number > 0")
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"sigma={sigma} must be a finite number >= 0")
    counts, rep_sums, soft_sums = class_sums(model, batches, num_classes, temperature, zeta)
    total = int(counts.sum())
    out: Knowledge = {}
    for j in range(num_classes):
        n_j = int(counts[j])
        if n_j == 0 or n_j < nu * total:
            continue
        rep = rep_sums[j] / n_j
        if sigma > 0:
            std = sigma * 2.0 * zeta / n_j
            noise = torch.randn(rep.shape, generator=generator, dtype=torch.float64)
            rep = rep + std * noise
        out[j] = ClassKnowledge(j, n_j, rep.float(), (soft_sums[j] / n_j).float())
    return out


def stack_knowledge(knowledge: Knowledge, like: Tensor) -> tuple[list[int], Tensor, Tensor]:
    """``(sorted class ids, reps (K, code_len), softs (K, C))`` on ``like``'s device and dtype."""
    ids = sorted(knowledge)
    reps = torch.stack([knowledge[j].rep.reshape(-1) for j in ids]).to(device=like.device, dtype=like.dtype)
    softs = torch.stack([knowledge[j].soft.reshape(-1) for j in ids]).to(device=like.device, dtype=like.dtype)
    return ids, reps, softs


def knowledge_rows(ids: list[int], targets: Tensor) -> Tensor:
    """Row of each target's class in the stacked knowledge, ``-1`` where the class is absent."""
    targets = targets.reshape(-1).to(torch.int64)
    if targets.numel() and int(targets.min()) < 0:
        raise ValueError(f"targets must be >= 0, got {int(targets.min())}")
    size = max(ids[-1], int(targets.max()) if targets.numel() else 0) + 1
    table = torch.full((size,), -1, dtype=torch.int64, device=targets.device)
    table[torch.tensor(ids, dtype=torch.int64, device=targets.device)] = torch.arange(len(ids), device=targets.device)
    return table[targets]


def fedhkd_loss_terms(
    h: Tensor,
    targets: Tensor,
    classifier: nn.Module,
    global_knowledge: Knowledge,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """The two FedHKD regularisers ``(term1, term2)``; the caller forms ``CE + lambda*term1 + gamma*term2``.

    ``term1 = (1/|J|) sum_{j in J} || softmax(classifier(H^j) / T) - Q^j ||_2`` over the
    non-empty global classes ``J`` (gradient reaches the classifier only).
    ``term2 = (1/B) sum_b || h_b - H^{y_b} ||_2`` (unsquared norms) where samples whose class
    is empty contribute nothing but ``B`` stays the full batch size, so the term's scale
    does not depend on how many classes happen to be covered. With empty knowledge both
    terms are zeros connected to ``h``'s graph.
    """
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    h = h.reshape(h.shape[0], -1)
    zero = h[:0].sum()
    if not global_knowledge:
        return zero, zero.clone()
    ids, reps, softs = stack_knowledge(global_knowledge, h)
    pred = torch.softmax(classifier(reps) / temperature, dim=-1)
    term1 = torch.linalg.vector_norm(pred - softs, dim=-1).mean()
    rows = knowledge_rows(ids, targets.to(h.device))
    mask = rows >= 0
    if not bool(mask.any()):
        return term1, zero
    dists = torch.linalg.vector_norm(h[mask] - reps[rows[mask]], dim=-1)
    term2 = dists.sum() / h.shape[0]
    return term1, term2

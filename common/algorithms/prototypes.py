"""FedProto: class prototypes (mean representations) and the ``MSE(h, proto_y)`` regulariser (Tan,
Long, Liu, Zhou, Lu, Jiang and Zhang, "FedProto: Federated Prototype Learning across Heterogeneous
Clients", AAAI 2022; the method is :mod:`~wafl.common.algorithms.fedproto`).

Prototypes travel in the same :data:`Knowledge` message as FedHKD's hyper-knowledge (``soft``
holds the mean softmax at ``T = 1``) and the server averages them with
:func:`wafl.common.knowledge.aggregate_knowledge`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn
from wafl.common.algorithms.hyperknowledge import class_sums, knowledge_rows, stack_knowledge
from wafl.common.knowledge import ClassKnowledge, Knowledge

__all__ = ["extract_prototypes", "fedproto_paper_term", "fedproto_term"]


def extract_prototypes(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]], num_classes: int) -> Knowledge:
    """Per class present in ``batches``: the mean representation (no clipping, no noise, no
    threshold) and the mean ``softmax(logits)``; eval mode, no grad, mode restored; float32 on the CPU."""
    counts, rep_sums, soft_sums = class_sums(model, batches, num_classes, temperature=1.0, zeta=None)
    out: Knowledge = {}
    for j in range(num_classes):
        n_j = int(counts[j])
        if n_j > 0:
            out[j] = ClassKnowledge(j, n_j, (rep_sums[j] / n_j).float(), (soft_sums[j] / n_j).float())
    return out


def fedproto_term(h: Tensor, targets: Tensor, global_knowledge: Knowledge) -> Tensor:
    """``MSE(h_b, proto_{y_b})`` averaged over the samples whose class has a prototype and over
    the dimensions; a zero connected to ``h``'s graph when no sample has one."""
    h = h.reshape(h.shape[0], -1)
    zero = h[:0].sum()
    if not global_knowledge:
        return zero
    ids, protos, _ = stack_knowledge(global_knowledge, h)
    rows = knowledge_rows(ids, targets.to(h.device))
    mask = rows >= 0
    if not bool(mask.any()):
        return zero
    return ((h[mask] - protos[rows[mask]]) ** 2).mean()


def fedproto_paper_term(h: Tensor, targets: Tensor, global_knowledge: Knowledge) -> Tensor:
    """FedProto's regulariser as in its paper: ``(1/(B d)) sum_b ||h_b - proto_{y_b}||^2`` over
    every sample and dimension, a sample whose class has no prototype contributing 0."""
    h = h.reshape(h.shape[0], -1)
    zero = h[:0].sum()
    if not global_knowledge or h.shape[0] == 0:
        return zero
    ids, protos, _ = stack_knowledge(global_knowledge, h)
    rows = knowledge_rows(ids, targets.to(h.device))
    mask = rows >= 0
    if not bool(mask.any()):
        return zero
    return ((h[mask] - protos[rows[mask]]) ** 2).sum() / h.numel()

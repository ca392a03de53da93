"""Loss terms shared by several methods, and the server-side momentum step.

Client terms (each returns a scalar tensor with a gradient):

* :func:`proximal_term`: FedProx, and Ditto's personal objective, ``(mu/2) ||w - w_g||^2``.
* :func:`asd_term`: adaptive self-distillation, ``sum_i alpha_i KL(global || local)_i``.
* :func:`ntd_term`: FedNTD not-true distillation.

Parameter lists (an ``anchor``, a client's per-parameter state) are aligned with the model's
trainable parameters (``requires_grad``) in ``model.parameters()`` order; :func:`trainable_params`
and :func:`params_snapshot` produce such lists and :func:`aligned` pairs and checks them.

The server update :func:`fedavgm_update` works on one tensor at a time and returns new tensors;
FedAvgM applies it to every trained tensor of the model (``is_weight``: normalization statistics are
averaged, not given momentum).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters with ``requires_grad``, in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def params_snapshot(model: nn.Module) -> list[Tensor]:
    """Detached copies of the trainable parameters, usable as an ``anchor``."""
    return [p.detach().clone() for p in trainable_params(model)]


def aligned(model: nn.Module, other: Sequence[Tensor], name: str) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, tensor)`` pairs of the trainable parameters and ``other`` (detached, on the
    parameter's device and dtype); ``ValueError`` naming ``name`` when the counts or shapes differ."""
    params = trainable_params(model)
    if not params:
        raise ValueError("model has no trainable parameters")
    if len(params) != len(other):
        raise ValueError(f"{name} has {len(other)} tensors but the model has {len(params)} trainable parameters")
    pairs: list[tuple[Tensor, Tensor]] = []
    for i, (p, o) in enumerate(zip(params, other)):
        if p.shape != o.shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(o.shape)}, parameter has {tuple(p.shape)}")
        pairs.append((p, o.detach().to(device=p.device, dtype=p.dtype)))
    return pairs


def proximal_term(model: nn.Module, anchor: Sequence[Tensor], mu: float) -> Tensor:
    """``(mu/2) * sum ||w - w_anchor||^2`` over the trainable parameters (anchor is a constant)."""
    # A tensor, not the start value 0: aligned raises when the model has no trainable parameters.
    total = cast(Tensor, sum(((p - a) ** 2).sum() for p, a in aligned(model, anchor, "anchor")))
    return 0.5 * mu * total


def _check_logits(student_logits: Tensor, teacher_logits: Tensor, targets: Tensor) -> None:
    if student_logits.dim() != 2 or student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"logits must be (B, C) and equal in shape, got {tuple(student_logits.shape)} "
            f"and {tuple(teacher_logits.shape)}"
        )
    if targets.shape != (student_logits.shape[0],):
        raise ValueError(f"targets must have shape (B,)=({student_logits.shape[0]},), got {tuple(targets.shape)}")
    if student_logits.shape[0] == 0:
        raise ValueError("empty batch")


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def asd_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """Per-sample ``KL(softmax(s/T) || softmax(z/T))`` (global || local), no ``T^2`` factor; shape (B,)."""
    _check_temperature(temperature)
    log_qg = F.log_softmax(teacher_logits.detach() / temperature, dim=1)
    log_qk = F.log_softmax(student_logits / temperature, dim=1)
    return (log_qg.exp() * (log_qg - log_qk)).sum(dim=1)


@torch.no_grad()
def asd_weights(teacher_logits: Tensor, targets: Tensor, label_freq: Tensor, uniform: bool = False) -> Tensor:
    """ASD sample weights ``alpha_i = a_i / sum_j a_j`` with ``a_i = exp(-H_i) / p_k(y_i)``; shape (B,).

    ``H_i`` is the entropy of ``softmax(s_i)`` (temperature 1). ``label_freq`` may hold counts or
    frequencies (the batch normalization cancels the scale); a target whose class frequency is
    not positive raises ``ValueError``. ``uniform`` gives ``1/B``. No gradient flows through.
    """
    b = teacher_logits.shape[0]
    if uniform:
        return torch.full((b,), 1.0 / b, dtype=teacher_logits.dtype, device=teacher_logits.device)
    freq = label_freq.to(device=teacher_logits.device, dtype=teacher_logits.dtype)
    p_y = freq[targets]
    if bool((p_y <= 0).any()):
        bad = sorted({int(c) for c in targets[p_y <= 0].tolist()})
        raise ValueError(f"label frequency is zero (or negative) for target class(es) {bad}")
    log_p = F.log_softmax(teacher_logits.detach(), dim=1)
    entropy = -(log_p.exp() * log_p).sum(dim=1)
    # alpha = exp(-H - log p_y) / sum(...), computed as a softmax over the batch for stability
    return torch.softmax(-entropy - torch.log(p_y), dim=0)


def asd_term(
    student_logits: Tensor,
    teacher_logits: Tensor,
    targets: Tensor,
    label_freq: Tensor,
    temperature: float = 2.0,
    uniform: bool = False,
) -> Tensor:
    """Adaptive self-distillation ``sum_i alpha_i KL_i`` (see :func:`asd_kl`, :func:`asd_weights`).

    The teacher (received global model) logits are detached; the weights carry no gradient.
    Multiply by ``lambda`` and add to the cross-entropy.
    """
    _check_logits(student_logits, teacher_logits, targets)
    kl = asd_kl(student_logits, teacher_logits, temperature)
    alpha = asd_weights(teacher_logits, targets, label_freq, uniform).to(kl.dtype)
    return (alpha * kl).sum()


def not_true_logits(logits: Tensor, targets: Tensor) -> Tensor:
    """``logits`` (B, C) without each row's true-class column, shape (B, C-1), order kept."""
    b, c = logits.shape
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[torch.arange(b, device=logits.device), targets] = False
    return logits[keep].reshape(b, c - 1)


def ntd_term(student_logits: Tensor, teacher_logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """FedNTD not-true distillation (Lee et al., 2022).

    The true-class column is removed from both logits; the remaining ``C-1`` logits are
    softened at temperature ``T``; the loss is ``KL(teacher || student)`` averaged over the batch
    and multiplied by ``T^2``, as in the FedNTD paper. The teacher logits are detached.
    """
    _check_logits(student_logits, teacher_logits, targets)
    _check_temperature(temperature)
    if student_logits.shape[1] < 2:
        raise ValueError("not-true distillation needs at least 2 classes")
    log_q_s = F.log_softmax(not_true_logits(student_logits, targets) / temperature, dim=1)
    log_q_t = F.log_softmax(not_true_logits(teacher_logits.detach(), targets) / temperature, dim=1)
    kl = (log_q_t.exp() * (log_q_t - log_q_s)).sum(dim=1)
    return temperature**2 * kl.mean()


@torch.no_grad()
def fedavgm_update(
    global_w: Tensor, averaged_w: Tensor, velocity: Tensor, beta: float, eta: float
) -> tuple[Tensor, Tensor]:
    """FedAvgM server step on one tensor: ``Delta = w_g - avg``, ``v <- beta v + Delta``, ``w <- w_g - eta v``.

    Returns ``(new_global, new_velocity)``; ``averaged_w`` is the sample-weighted client mean.
    """
    delta = global_w - averaged_w
    new_velocity = beta * velocity + delta
    return global_w - eta * new_velocity, new_velocity

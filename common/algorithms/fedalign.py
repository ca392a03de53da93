"""FedAlign (Mendieta, Yang, Wang, Lee, Ding and Chen, "Local Learning Matters: Rethinking Data
Heterogeneity in Federated Learning", CVPR 2022): local learning generality through Lipschitz
alignment of the final block between the full network and a width-reduced sub-network.

On a batch, with ``x`` the input of the feature extractor's final block ``B`` and ``h = B(x)`` its
output (the full network), and ``h_s = B_w(x_w)`` the same block at width ``w`` on ``x_w``, the first
``ceil(w * C)`` of the input's ``C`` features (detached): as the slimmable blocks of the authors' code
(``reuse_feature`` slices the input, and the block at width ``w`` keeps the first ``ceil(w * n)`` of
its hidden and output units),

    FSP(a, b) = a b^T / (spatial size)                              (per sample; 1 for a vector)
    L(a, b)   = sqrt(lambda_max(FSP(a, b) FSP(a, b)^T))              (10 power iterations from ones, on
                                                                     the smaller Gram matrix)
    L_lip     = (1/B) sum_b (L(x_w,b, h_s,b) - L(x_b, h_b.detach()))^2
    loss      = CE + mu * (CE / L_lip).detach() * L_lip

(the authors' code: the Lipschitz term is rescaled to ``mu`` times the cross-entropy's value and
only trains the sub-network's slice; gradients are clipped to norm 10 before the step). ``mu``
0.45 and ``w`` 0.25, the paper's. The final block here is the last ``Linear - ReLU - Linear`` of
the feature extractor, with the ``ReLU`` after it when the extractor ends in one (the digits CNN's
block ends in its ``Linear``, LeNet-5's in a ``ReLU``, as the residual blocks of the authors' ResNets
do; the sub-network's block then ends in it too); other models are refused with a message saying so.
The power iteration divides by norms clamped to 1e-12, so a sub-network whose units are all
inactive on a sample gives an estimate of 0 there rather than NaN. The server is FedAvg.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from wafl.common.algorithms.base import (
    Algorithm,
    ClippedStep,
    Forward,
    LossTerm,
    Phase,
    RoundContext,
)
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register

EPS = 1e-12


def final_block(model: nn.Module) -> tuple[nn.Module, nn.Linear, nn.Linear, bool]:
    """``(everything before the block, its first Linear, its last Linear, whether a ReLU ends it)``."""
    message = (
        "fedalign needs a feature extractor ending in Linear - ReLU - Linear, optionally with a ReLU after it "
        "(the cnn, lenet5)"
    )
    f = model.features
    if not isinstance(f, nn.Sequential):
        raise ValueError(message)
    relu_out = len(f) >= 4 and isinstance(f[-1], nn.ReLU)
    end = len(f) - 1 if relu_out else len(f)
    if end < 3:
        raise ValueError(message)
    a, act, b = f[end - 3], f[end - 2], f[end - 1]
    if not (isinstance(a, nn.Linear) and isinstance(act, nn.ReLU) and isinstance(b, nn.Linear)):
        raise ValueError(message)
    return f[: end - 3], a, b, relu_out


def transmitting_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a b^T / spatial size`` per sample, for ``(B, C1[, H, W])`` and ``(B, C2[, H, W])``."""
    a = a.reshape(a.shape[0], a.shape[1], -1)
    b = b.reshape(b.shape[0], b.shape[1], -1)
    return torch.bmm(a, b.transpose(1, 2)) / a.shape[2]


def top_singular_value(m: torch.Tensor, iterations: int = 10) -> torch.Tensor:
    """``sqrt(lambda_max(M M^T))`` per sample by power iteration from ones, shape ``(B,)``; it runs on
    the smaller of ``M M^T`` and ``M^T M`` (the same top eigenvalue)."""
    k = torch.bmm(m, m.transpose(1, 2)) if m.shape[1] <= m.shape[2] else torch.bmm(m.transpose(1, 2), m)
    v = torch.ones(k.shape[0], k.shape[1], 1, dtype=k.dtype, device=k.device)
    n = torch.ones(k.shape[0], 1, 1, dtype=k.dtype, device=k.device)
    for _ in range(iterations):
        w = torch.bmm(k, v)
        n = torch.linalg.vector_norm(w, dim=1, keepdim=True)
        v = w / n.clamp_min(EPS)
    return torch.sqrt((n / torch.linalg.vector_norm(v, dim=1, keepdim=True).clamp_min(EPS)).clamp_min(EPS)).reshape(-1)


def width_slice(n: int, width: float) -> int:
    """How many of ``n`` units a block keeps at ``width``."""
    return max(1, math.ceil(width * n))


def sub_block(
    first: nn.Linear, last: nn.Linear, x: torch.Tensor, width: float, relu_out: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_w, h_s)``: the input's first ``ceil(w * C)`` features and the block at width ``w`` on them
    (ending in a ReLU with ``relu_out``, as the full block does)."""
    i, k, o = (width_slice(n, width) for n in (first.in_features, first.out_features, last.out_features))
    xs = x[:, :i]
    hidden = F.relu(F.linear(xs, first.weight[:k, :i], first.bias[:k] if first.bias is not None else None))
    out = F.linear(hidden, last.weight[:o, :k], last.bias[:o] if last.bias is not None else None)
    return xs, F.relu(out) if relu_out else out


def lipschitz_gap(x: torch.Tensor, h: torch.Tensor, x_sub: torch.Tensor, h_sub: torch.Tensor) -> torch.Tensor:
    """``L_lip`` above: the mean squared gap of the two blocks' Lipschitz estimates."""
    full = top_singular_value(transmitting_matrix(x, h))
    sub = top_singular_value(transmitting_matrix(x_sub, h_sub))
    return F.mse_loss(sub, full)


class LipschitzAlignment(LossTerm):
    name = "fedalign"

    def __init__(self, mu: float, width: float) -> None:
        self.mu, self.width = mu, width

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        pre, first, last, relu_out = final_block(model)
        with torch.no_grad():
            x = pre(out.x)
        gap = lipschitz_gap(x, out.h.detach(), *sub_block(first, last, x, self.width, relu_out))
        ce = F.cross_entropy(out.logits, out.y).detach()
        return self.mu * (ce / gap.detach().clamp_min(EPS)) * gap


@dataclass(frozen=True)
class FedAlignParams:
    mu: float = param(0.45, ">= 0")
    width: float = param(0.25, "(0, 1]")


def build(p: FedAlignParams, run: Mapping[str, Any]) -> Algorithm:
    return Algorithm(
        "fedalign",
        phases=[Phase("gm", terms=[LipschitzAlignment(p.mu, p.width)], step=ClippedStep(10.0))],
    )


register("fedalign", FedAlignParams, build)

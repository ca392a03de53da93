"""Spectral co-distillation (SCD): GM and PM distil each other through their weight spectra.

Chen, Yang, Quek and Chong, "Spectral Co-Distillation for Personalized Federated Learning",
NeurIPS 2023; the equations its text lost are restated below.

GM, starting from the received global model: ``CE + lambda_g * D(trunc_tau s(w_G) || trunc_tau s(w_p^{t-1}))``.
PM, after the GM update: ``CE + lambda_p * D(s(w_p) || s(w_G,i^t))``. The teacher's spectrum is
taken once per phase (frozen); a zero weight drops the term, so ``lambda_g = lambda_p = 0``
trains the GM exactly as FedAvg does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from wafl.common.algorithms.base import Algorithm, AlgorithmStateError, Forward, LossTerm, RoundContext
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register
from wafl.common.algorithms.spectral import (
    SpectralTarget,
    SpectrumMode,
    prepare_target,
    spectral_divergence,
    teacher_spectrum,
)


class SpectralDistillation(LossTerm):
    """``weight * D(student spectrum || teacher spectrum)``; the teacher is the PM (for the GM) or the GM (for the
    PM)."""

    def __init__(self, weight: float, teacher: str, mode: SpectrumMode, tau: float | None) -> None:
        self.weight, self.teacher, self.mode, self.tau = weight, teacher, mode, tau
        self.name = f"scd_{'gm' if teacher == 'pm' else 'pm'}"
        self.target: SpectralTarget | None = None

    def begin(self, ctx: RoundContext, model: nn.Module) -> None:
        source = ctx.pm if self.teacher == "pm" else ctx.gm
        if source is None:
            raise AlgorithmStateError(f"scd: the {self.name} term's teacher, the {self.teacher.upper()}, was not built")
        self.target = prepare_target(teacher_spectrum(source, self.mode), self.mode, self.tau)

    def __call__(self, model: nn.Module, out: Forward, ctx: RoundContext) -> torch.Tensor:
        if self.target is None:
            raise AlgorithmStateError(f"scd: the {self.name} term ran before its phase began (no teacher spectrum)")
        return self.weight * spectral_divergence(model, self.target)


@dataclass(frozen=True)
class SCDParams:
    lambda_g: float = param(0.3, ">= 0")
    lambda_p: float = param(0.4, ">= 0")
    tau: float = param(0.4, "(0, 1]")
    spectrum: Literal["model", "layer"] = param("model", "model|layer")


def build(p: SCDParams, run: Mapping[str, Any]) -> Algorithm:
    gm: list[LossTerm] = [SpectralDistillation(p.lambda_g, "pm", p.spectrum, p.tau)] if p.lambda_g > 0 else []
    pm: list[LossTerm] = [SpectralDistillation(p.lambda_p, "gm", p.spectrum, None)] if p.lambda_p > 0 else []
    return Algorithm("scd", gm_terms=gm, pm_terms=pm)


register("scd", SCDParams, build)

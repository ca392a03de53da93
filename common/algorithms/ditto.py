"""Ditto (Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021): the GM trains with plain cross-entropy and is averaged; the PM ``v`` trains with
``CE + (mu/2) ||v - w_global||^2`` and never leaves the client."""

from __future__ import annotations

from dataclasses import dataclass

from wafl.common.algorithms.base import Algorithm
from wafl.common.algorithms.fedprox import Proximal
from wafl.common.algorithms.params import param
from wafl.common.algorithms.registry import register


@dataclass(frozen=True)
class DittoParams:
    mu: float = param(0.1, "> 0")


register("ditto", DittoParams, lambda p, run: Algorithm("ditto", pm_terms=[Proximal(p.mu)]))

"""FedAvg: plain cross-entropy locally, sample-weighted mean on the server."""

from __future__ import annotations

from wafl.common.algorithms.base import Algorithm
from wafl.common.algorithms.registry import register

register("fedavg", {}, lambda p, run: Algorithm("fedavg", p))

"""FedAvg (McMahan, Moore, Ramage, Hampson and Agüera y Arcas, "Communication-Efficient Learning of
Deep Networks from Decentralized Data", AISTATS 2017): plain cross-entropy locally, sample-weighted
mean on the server."""

from __future__ import annotations

from wafl.common.algorithms.base import Algorithm
from wafl.common.algorithms.params import NoParams
from wafl.common.algorithms.registry import register

register("fedavg", NoParams, lambda p, run: Algorithm("fedavg"))

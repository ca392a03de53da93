"""The bound on each upload's influence: the L2 norm of its update, measured chunk by chunk as it folds.

With ``clip_norm`` an upload whose update (its floating-point tensors minus the reference, the global
model it was trained from; buffered uploads are updates already) has an L2 norm above the bound is
scaled down to it when it commits. Without ``clip_norm`` the bound is adaptive by default
(:class:`NormBound`, ``norm_bound`` in the configuration): a multiple of the median norm of recently
accepted updates. Updates beyond what float32 can square are refused outright (:data:`MAX_UPDATE_NORM`).
"""

from __future__ import annotations

import math

import numpy as np
from wafl.common.algorithms.base import EXTRA_PREFIX

# An update whose L2 norm exceeds this is refused: its square overflows float32, the dtype models
# are kept and averaged in (a client or server summing squares in float32 would get Inf).
MAX_UPDATE_NORM = math.sqrt(float(np.finfo(np.float32).max))  # about 1.8e19

# NumPy's OpenBLAS computes a dot product of more than 10,000 values on its worker threads (as many as the
# cores), which spin while they wait for work: under load they take the cores from the training, and
# the sum's order, so its last bits, depends on how many cores the machine has. ``sq_norm`` takes the
# dot product block by block, each block under that threshold: one thread, the same bits everywhere.
SQ_NORM_BLOCK = 10_000


def sq_norm(d: np.ndarray) -> float:
    """``d . d`` of a 1-D float64 array, summed in blocks of :data:`SQ_NORM_BLOCK` values (each a single-
    threaded BLAS dot): the same bits on every machine for one BLAS build, and no BLAS threads woken."""
    total = 0.0  # one block (up to SQ_NORM_BLOCK values): 0.0 + np.dot(d, d), exactly np.dot's value
    for i in range(0, d.size, SQ_NORM_BLOCK):
        b = d[i : i + SQ_NORM_BLOCK]
        total += float(np.dot(b, b))
    return total


def bounded(name: str) -> bool:
    """Whether clipping bounds a travelling tensor: the model's, not an algorithm's extra tensors
    (control variates, a generator, label counts, per-client rows of a summed tensor), whose values
    are not an update of the model and whose scale says nothing of one."""
    return not name.startswith(EXTRA_PREFIX)


class NormBound:
    """The default bound on each update's influence: ``multiple`` x the median L2 norm of the updates
    accepted in the last ``window`` collections (each taken after its own clipping); before any, in
    the first round, ``multiple x first`` (1 by default) x the norm of the global model's
    floating-point tensors: an update no larger than the model itself (the largest honest
    first-round update on digits is 0.17 of it).

    Why this rule. Without a bound, the weighted mean has a breakdown point of zero: one upload of
    finite but huge values (1e30) moves the average anywhere (Blanchard et al. 2017). Bounding the
    norm of every update is the defence that costs honest federations nothing when the bound sits
    above their updates: Sun et al. 2019 ("Can you really backdoor federated learning?") show norm
    bounding removes most of an attacker's effect, and Andrew et al. 2021 ("Differentially private
    learning with adaptive clipping") set the bound from a quantile of the clients' update norms
    instead of a hand-tuned constant, since update norms change by orders of magnitude with the
    model, the learning rate and the round. The median of the accepted norms is that quantile in its
    most robust form: fewer than half of the uploads, however large, cannot move it, and an
    attacker's own clipped norms enter it at most at the bound. Departure: the *lower* median
    (:func:`lower_median`, the ``ceil(n/2)``-th smallest of ``n`` norms), not the mean of the two
    middle ones when ``n`` is even. With the mean, an attacker holding exactly half of the uploads (one
    of two clients) lifts the bound by half its own clipped norm every round, which its next upload
    reaches again: 10 -> 67 -> 354 -> ... -> 44,921 in 16 rounds over honest norms of 3.9. The lower
    median of ``n`` norms of which at most half are the attacker's is at most the largest honest norm
    of the window, so the bound stays at most ``multiple`` x that; with an odd ``n`` it is the
    median itself, the same value as before. The ``multiple`` (10 by default)
    leaves room for the spread of honest non-IID updates (clients with more data take more steps):
    on digits (10 clients, Dirichlet 0.5; FedAvg, FedDyn, SCAFFOLD) the largest honest update was
    1.3-2.5 x the previous rounds' median, so seeded honest runs build bit-identical
    models with the bound and without. An attacker then moves the model at most by its weight times
    ``multiple`` honest updates, instead of arbitrarily. Updates beyond what float32 can square are
    refused outright (:data:`MAX_UPDATE_NORM`).
    """

    def __init__(self, multiple: float, window: int = 3, first: float = 0.1) -> None:
        self.multiple = multiple
        self.window = window
        self.first = first
        self.history: list[list[float]] = []  # accepted norms of the last collections, oldest first

    def bound(self, reference_norm: float) -> float | None:
        if self.multiple <= 0:
            return None
        norms = [n for h in self.history for n in h]
        if norms:
            return self.multiple * lower_median(norms)
        return self.multiple * self.first * reference_norm if reference_norm > 0 else None

    def record(self, norms: list[float]) -> None:
        if norms:
            self.history = [*self.history, list(norms)][-self.window :]

    def state_dict(self) -> list[list[float]]:
        return [list(h) for h in self.history]

    def load_state_dict(self, history: list[list[float]]) -> None:
        self.history = [[float(n) for n in h] for h in history][-self.window :]


def lower_median(values: list[float]) -> float:
    """The ``ceil(n/2)``-th smallest of ``n`` values: the median for odd ``n``, the lower middle one for even ``n``."""
    return float(sorted(values)[(len(values) - 1) // 2])

"""Which clients train in a round: a fixed fraction, or independent activation with ``act_prob``.

A pure function of (seed, round, client ids), so a run, its resumption and an in-process
simulation of it select the same clients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def select_clients(
    seed: int, round: int, ids: Sequence[str], fraction: float = 1.0, act_prob: float | None = None
) -> set[str]:
    """``ids`` in client-index order. With ``act_prob`` each client is active independently
    (one is drawn at random if none is); otherwise ``round(fraction * len(ids))`` (at least one)
    are drawn without replacement."""
    rng = np.random.default_rng([seed, 5, round])
    if act_prob is not None:
        chosen = [c for c, u in zip(ids, rng.random(len(ids))) if u < act_prob]
        return set(chosen) if chosen else {ids[int(rng.integers(len(ids)))]}
    k = max(1, int(math.floor(fraction * len(ids) + 0.5)))
    return {ids[i] for i in rng.choice(len(ids), size=k, replace=False)}

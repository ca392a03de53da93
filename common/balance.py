"""Items in groups of nearly equal load: clients over worker processes or training processes."""

from __future__ import annotations

from collections.abc import Sequence


def balanced_groups(sizes: Sequence[int], groups: int) -> list[list[int]]:
    """Indices ``0..len(sizes)-1`` in ``groups`` groups of nearly equal total size: the largest item
    goes to the group with the least so far (ties: the group with fewer items, then the lower one);
    indices ascending within each group. Deterministic: the same sizes give the same groups."""
    if groups < 1:
        raise ValueError(f"groups={groups} must be at least 1")
    out: list[list[int]] = [[] for _ in range(groups)]
    load = [0] * groups
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(groups), key=lambda g: (load[g], len(out[g]), g))
        out[g].append(i)
        load[g] += sizes[i]
    return [sorted(g) for g in out]

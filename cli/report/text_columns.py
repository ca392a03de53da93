"""A bench's text summary: one column per run or protocol, one line per measured key."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


def key_lines(
    columns: Mapping[str, Mapping[str, Any]],
    keys: Sequence[str],
    fmt: Callable[[Any], str],
    key_width: int,
    width: int,
) -> list[str]:
    """A heading line of the column names, then per key the key and each column's value (``fmt``; a missing
    value is ``fmt(None)``), left-aligned keys in ``key_width`` and right-aligned values in ``width``."""
    names = list(columns)
    lines = [f"{'':<{key_width}}" + "".join(f"{n:>{width}}" for n in names)]
    for k in keys:
        lines.append(f"{k:<{key_width}}" + "".join(f"{fmt(columns[n].get(k)):>{width}}" for n in names))
    return lines

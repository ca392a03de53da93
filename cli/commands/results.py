"""``wafl sweep`` (one federation per point of a grid) and ``wafl table`` (the table over their seeds)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wafl.common.config import ConfigError


def cmd_sweep(a: argparse.Namespace) -> int:
    from wafl.cli.sweep import sweep

    if a.jobs < 1:
        raise ConfigError(f"--jobs={a.jobs} must be >= 1")
    out = Path(a.out) if a.out else None
    return sweep(Path(a.file), network=a.network, jobs=a.jobs, out=out, show_progress=not a.quiet)


def cmd_table(a: argparse.Namespace) -> int:
    from wafl.cli.table import TableError, main

    try:
        return main(a.dirs, a.by, a.target, a.baseline, a.json, a.metrics)
    except TableError as e:
        print(f"wafl: {e}", file=sys.stderr)
        return 2

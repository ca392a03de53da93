"""``wafl sweep`` (one federation per point of a grid) and ``wafl table`` (the table over their seeds)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wafl.common.config import ConfigError


def cmd_sweep(a: argparse.Namespace) -> int:
    from wafl.cli.experiments.sweep import sweep

    if a.jobs < 1:
        raise ConfigError(f"--jobs={a.jobs} must be >= 1")
    if a.slot_processes < 0:
        raise ConfigError(f"--slot-processes={a.slot_processes} must be >= 0")
    if a.slot_processes and a.network:
        raise ConfigError("--slot-processes is for in-process points; with --network each client is a process")
    if a.snapshot_every < 0:
        raise ConfigError(f"--snapshot-every={a.snapshot_every} must be >= 0")
    out = Path(a.out) if a.out else None
    return sweep(
        Path(a.file),
        network=a.network,
        jobs=a.jobs,
        out=out,
        show_progress=not a.quiet,
        slot_processes=a.slot_processes,
        snapshot_every=a.snapshot_every,
        first=a.first,
    )


def cmd_table(a: argparse.Namespace) -> int:
    from wafl.cli.report.table import TableError, main

    try:
        return main(a.dirs, a.by, a.target, a.baseline, a.json, a.metrics, a.within)
    except TableError as e:
        print(f"wafl: {e}", file=sys.stderr)
        return 2

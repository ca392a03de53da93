"""One federation of a benchmark, measured: every host with its CPU share, the machine's load around it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from wafl.cli.launch.hosts import parse_hosts
from wafl.cli.launch.launcher import launch
from wafl.common.config import RunConfig


def launch_measured(
    run_cfg: RunConfig,
    run_dir: Path,
    link_rate: str | None,
    show_progress: bool,
    timeout_s: float,
    host_cpus: str | None,
) -> tuple[Any, dict[str, Any]]:
    """One federation of a benchmark (``wafl.cli.launch``): every host with its CPU share
    (``host_cpus``; None: ``auto`` where control groups can be used, else shared cores with a
    warning); returns the launcher's summary and the machine's load average before and after.
    Model files are removed afterwards (weights are not a measurement)."""
    before = os.getloadavg()
    summary = launch(
        run_cfg,
        run_dir,
        hosts=parse_hosts(
            run_cfg, link_rate=link_rate, host_cpus=host_cpus or "auto", quota_optional=host_cpus is None
        ),
        show_progress=show_progress,
        timeout_s=timeout_s,
    )
    after = os.getloadavg()
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "clients", ignore_errors=True)
    load = {"before_1m": round(before[0], 2), "after_1m": round(after[0], 2), "after_5m": round(after[1], 2)}
    return summary, {**load, "cpus": os.cpu_count()}

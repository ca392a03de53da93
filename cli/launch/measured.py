"""One federation of a benchmark, measured: every host with its CPU share, the machine's load around it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from wafl.cli.launch.hosts import Hosts, parse_hosts
from wafl.cli.launch.launcher import launch
from wafl.common.config import RunConfig


def measured_hosts(cfg: RunConfig, link_rate: str | None = None, host_cpus: str | None = None) -> Hosts:
    """A benchmark's hosts, parsed once for ``cfg`` (a :class:`~wafl.common.config.ConfigError` naming the flag
    otherwise): the links ``link_rate`` (None: loopback) and every host's CPU share ``host_cpus`` (None:
    ``auto`` where control groups can be used, else shared cores with a warning)."""
    return parse_hosts(cfg, link_rate=link_rate, host_cpus=host_cpus or "auto", quota_optional=host_cpus is None)


def launch_measured(
    run_cfg: RunConfig, run_dir: Path, hosts: Hosts, show_progress: bool, timeout_s: float
) -> tuple[Any, dict[str, Any]]:
    """One federation of a benchmark (``wafl.cli.launch``) on ``hosts`` (:func:`measured_hosts`, parsed for a
    configuration with ``run_cfg``'s clients and seed); returns the launcher's summary and the machine's load
    average before and after. Model files are removed afterwards (weights are not a measurement)."""
    before = os.getloadavg()
    summary = launch(run_cfg, run_dir, hosts=hosts, show_progress=show_progress, timeout_s=timeout_s)
    after = os.getloadavg()
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "clients", ignore_errors=True)
    load = {"before_1m": round(before[0], 2), "after_1m": round(after[0], 2), "after_5m": round(after[1], 2)}
    return summary, {**load, "cpus": os.cpu_count()}

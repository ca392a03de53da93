"""What machine a benchmark ran on, and what it did meanwhile (shared by the scripts in this folder)."""

from __future__ import annotations

import platform
import threading
from pathlib import Path


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


class Sampler:
    """Calls :meth:`sample` every ``period_s`` in a thread while in its ``with`` block; :meth:`sample`
    returning False ends the sampling early."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.sample() is False:
                return

    def sample(self) -> bool | None:
        raise NotImplementedError


def provenance() -> dict[str, object]:
    """What every results JSON records: the commit measured, the machine, the load average now."""
    import os
    from datetime import UTC, datetime

    from wafl.cli.report.provenance import git_commit

    return {
        "commit": git_commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "loadavg_end": list(os.getloadavg()),
    }

"""/proc readers: a process's memory and per-thread CPU time, the load average, an RSS sampler."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM / ... of a process, in bytes."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("Vm", "Rss")) and line.endswith("kB"):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user+system CPU seconds) for every thread of ``pid``."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return out


def cpu_delta(pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two ``thread_cpu`` readings, by thread group."""
    groups: dict[str, float] = {}
    for tid, (comm, t1) in after.items():
        t0 = before.get(tid, (comm, 0.0))[1]
        name = "main (asyncio event loop)" if tid == pid else f"other threads named {comm!r}"
        groups[name] = groups.get(name, 0.0) + (t1 - t0)
    groups = {k: round(v, 3) for k, v in sorted(groups.items()) if v > 0}
    groups["total"] = round(sum(groups.values()), 3)
    return groups


def proc_meminfo_total() -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


class RssSampler(threading.Thread):
    """Polls a process's VmRSS every few milliseconds (a cross-check of VmHWM)."""

    def __init__(self, pid: int, period_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, int]] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self.samples.append((time.monotonic(), proc_status(self.pid)["VmRSS"]))
            except (FileNotFoundError, ProcessLookupError, KeyError):
                return
            time.sleep(self.period_s)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(2)

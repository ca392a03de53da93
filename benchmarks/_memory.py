"""Peak memory of a process tree: RSS and PSS summed over a process and all its descendants.

PSS (proportional set size) counts a page shared by k processes as 1/k in each, so its sum over a
tree is what the tree holds; the summed RSS counts shared pages (torch's libraries, pages forked
copy-on-write) once per process. Read from ``/proc/PID/smaps_rollup`` (Linux 4.14+).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from _machine import Sampler


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (from ``/proc/*/stat``'s parent ids)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rollup(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) of one process in bytes, None when it is gone or unreadable."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    rss = pss = 0
    for line in text.splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Pss:"):
            pss = int(line.split()[1]) * 1024
    return rss, pss


class TreeMemory(Sampler):
    """Samples the summed RSS and PSS of ``root``'s tree every ``period_s``; keeps the peaks."""

    def __init__(self, root: int | None = None, period_s: float = 0.2) -> None:
        super().__init__(period_s)
        self.root = root if root is not None else os.getpid()
        self.peak_rss = self.peak_pss = 0
        self.peak_procs = 0
        self.samples = 0

    def sample(self) -> None:
        rss = pss = n = 0
        for pid in descendants(self.root):
            r = rollup(pid)
            if r is not None:
                rss, pss, n = rss + r[0], pss + r[1], n + 1
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.peak_procs = max(self.peak_procs, n)
        self.samples += 1

    def report(self) -> dict[str, Any]:
        return {
            "peak_rss_gb": round(self.peak_rss / 1e9, 3),
            "peak_pss_gb": round(self.peak_pss / 1e9, 3),
            "peak_processes": self.peak_procs,
            "samples": self.samples,
            "period_s": self.period_s,
        }

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


def cpu_and_role(pid: int) -> tuple[float, str] | None:
    """User + system CPU seconds of one process so far, and its role: the ``wafl`` subcommand it runs
    (``run``, ``server``, ``worker``, ``client``; a forked process keeps its parent's command line, so
    for those the role is read from its log file's name), else its program's name."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    role = next((a.decode() for a in argv if a.decode(errors="replace") in ROLES), "")
    try:
        log = os.readlink(f"/proc/{pid}/fd/1")
        name = Path(log).name
        if name.endswith(".log") and Path(log).parent.name == "logs":
            role = name.split("-")[0].removesuffix(".log")
    except OSError:
        pass
    if not role:
        role = "run" if b"run" in argv else (Path(argv[0].decode()).name if argv and argv[0] else "?")
    return cpu, role


CLK_TCK = os.sysconf("SC_CLK_TCK")
ROLES = ("server", "worker", "client")  # the wafl subcommands a process of a run may run


class TreeMemory(Sampler):
    """Samples the summed RSS and PSS of ``root``'s tree every ``period_s``; keeps the peaks, and each
    process's last CPU time seen (a process's CPU in its last ``period_s`` before it exits is missed)."""

    def __init__(self, root: int | None = None, period_s: float = 0.2) -> None:
        super().__init__(period_s)
        self.root = root if root is not None else os.getpid()
        self.peak_rss = self.peak_pss = 0
        self.peak_procs = 0
        self.samples = 0
        self.cpu: dict[int, tuple[float, str]] = {}

    def sample(self) -> None:
        rss = pss = n = 0
        for pid in descendants(self.root):
            c = cpu_and_role(pid)
            if c is not None:
                cpu, role = c
                # A role read from the command or the log stays: a forked process starts with its parent's
                # command line, and an exited one (a zombie until reaped) has neither, reading as "?".
                known = self.cpu.get(pid)
                if known is not None and (known[1] in ROLES or role == "?"):
                    role = known[1]
                self.cpu[pid] = (cpu, role)
            r = rollup(pid)
            if r is not None:
                rss, pss, n = rss + r[0], pss + r[1], n + 1
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.peak_procs = max(self.peak_procs, n)
        self.samples += 1

    def report(self) -> dict[str, Any]:
        by_role: dict[str, float] = {}
        for cpu, role in self.cpu.values():
            by_role[role] = round(by_role.get(role, 0.0) + cpu, 2)
        return {
            "cpu_s_by_role": by_role,
            "peak_rss_gb": round(self.peak_rss / 1e9, 3),
            "peak_pss_gb": round(self.peak_pss / 1e9, 3),
            "peak_processes": self.peak_procs,
            "samples": self.samples,
            "period_s": self.period_s,
        }

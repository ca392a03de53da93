#!/usr/bin/env python
"""The default job as a user starts it (``wafl run``, what ``make run`` runs): wall-clock and peak memory.

Run from the repository root::

    python benchmarks/main_job.py                       # the default job, twice; benchmarks/results/main_job.json
    python benchmarks/main_job.py --workers off         # one process per client, for comparison
    python benchmarks/main_job.py --smoke               # 2 rounds, 3 clients (what the test suite runs)

Each repetition starts ``wafl run`` (with ``--rounds``/``--clients`` when given, and any arguments after
``--``) as a child of this script and samples ``/proc/PID/smaps_rollup`` of the launcher and every
process below it every 0.2 s: the peak of the summed RSS and of the summed PSS (a page shared by k
processes counted 1/k in each: what the run holds). Wall-clock is from the launcher's start to its
exit, process start-up included; ``cpu_s`` is the CPU time of the whole tree (less sensitive to other
processes on the cores than the wall-clock). The final GM accuracy comes from the run's ``summary.json``. The
JSON names the commit and the load average before and after each repetition (other processes on the
cores slow a run down; the figures of a busy machine are not the machine's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import provenance
from _memory import TreeMemory

RESULTS = Path(__file__).resolve().parent / "results"


def _children_cpu() -> float:
    """User + system CPU seconds of every finished descendant (each process's parent waited for it)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(extra: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "wafl.cli.main", "run", "--quiet", "--out", str(out), *extra]
    load_before = os.getloadavg()
    cpu0 = _children_cpu()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    mem = TreeMemory(proc.pid)
    with mem:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    wall = time.monotonic() - t0
    cpu = _children_cpu() - cpu0
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    final = summary.get("final", {})
    return {
        "command": cmd[2:],
        "returncode": proc.returncode,
        "ok": bool(summary.get("ok")) and proc.returncode == 0,
        "wall_s": round(wall, 2),
        "run_wall_s": summary.get("wall_s"),
        "cpu_s": round(cpu, 2),
        "rounds": final.get("round"),
        "gm_accuracy": final.get("gm_accuracy"),
        "pm_accuracy": final.get("pm_accuracy"),
        **mem.report(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
        **({} if proc.returncode == 0 else {"output_tail": output.decode(errors="replace")[-2000:]}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="repetitions, one after another (default 2)")
    p.add_argument("--rounds", type=int, help="rounds (default: the run's default, 25)")
    p.add_argument("--clients", type=int, help="clients (default: the run's default, 10)")
    p.add_argument("--workers", help="passed to wafl run --workers (default: wafl run's own default)")
    p.add_argument("--smoke", action="store_true", help="2 rounds, 3 clients, one repetition: checks the script")
    p.add_argument("--out", type=Path, help="JSON to write (default benchmarks/results/main_job[-smoke].json)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per repetition before it is stopped")
    p.add_argument("extra", nargs="*", help="further wafl run arguments (after --)")
    a = p.parse_args(argv)
    if a.reps < 1:
        p.error("--reps must be at least 1")
    if a.smoke:
        a.rounds, a.clients, a.reps = a.rounds or 2, a.clients or 3, 1
    extra = list(a.extra)
    if a.rounds:
        extra += ["--rounds", str(a.rounds)]
    if a.clients:
        extra += ["--clients", str(a.clients)]
    if a.workers:
        extra += ["--workers", a.workers]
    runs = []
    with tempfile.TemporaryDirectory(prefix="wafl-main-job-") as tmp:
        for rep in range(a.reps):
            r = one_run(extra, Path(tmp) / f"run{rep}", a.timeout)
            runs.append(r)
            print(
                f"rep {rep}: ok={r['ok']} wall {r['wall_s']} s, peak PSS {r['peak_pss_gb']} GB, RSS {r['peak_rss_gb']}"
                f" GB over {r['peak_processes']} processes, cpu {r['cpu_s']} s, gm {r['gm_accuracy']}, "
                f"load {r['loadavg_before'][0]:.2f}",
                flush=True,
            )
    doc = {
        "benchmark": "main_job",
        **provenance(),
        "arguments": extra,
        "smoke": a.smoke,
        "runs": runs,
    }
    out = a.out or RESULTS / ("main_job-smoke.json" if a.smoke else "main_job.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

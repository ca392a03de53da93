#!/usr/bin/env python
"""The README's first SCD example under wait-free, compute-and-wait and wait-free with a PM floor.

Run from the repository root::

    python benchmarks/pm_floor.py            # writes benchmarks/results/pm_floor/<time>.json and .md
    python benchmarks/pm_floor.py --reps 2 --floor 20

Each repetition runs ``wafl run --algorithm scd --clients 4 --alpha 0.1`` (the quick start's
example: one server and four client processes sharing this machine's cores) three times, in turn:
``--protocol wait-free``, ``--protocol compute-and-wait`` and ``--protocol wait-free --set
pm_min_steps=FLOOR``. For each run it records the wall-clock time, the final GM and PM accuracy,
and per client its final PM accuracy, its test samples (the PM accuracy is their weighted mean) and
the PM steps it trained per round (median, min, max; from the clients' ``pm.trained`` log lines),
and the machine's load average before and after. The JSON and table are saved after every run.
A wait-free PM trains from its client's upload until the next broadcast, so the client whose GM
phase ends last gets the fewest PM steps; the floor trades round time for them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from _machine import cpu_name
from wafl.cli.report.provenance import git_commit
from wafl.cli.report.run_records import read_jsonl

RESULTS = Path(__file__).resolve().parent / "results" / "pm_floor"
EXAMPLE = ["--algorithm", "scd", "--clients", "4", "--alpha", "0.1"]


def settings(floor: int) -> dict[str, list[str]]:
    return {
        "wait-free": ["--protocol", "wait-free"],
        "compute-and-wait": ["--protocol", "compute-and-wait"],
        f"wait-free, pm_min_steps={floor}": ["--protocol", "wait-free", "--set", f"pm_min_steps={floor}"],
    }


def per_client(out: Path) -> dict[str, dict[str, Any]]:
    """Each client's final PM accuracy and test samples, and its PM steps per round."""
    clients: dict[str, dict[str, Any]] = {}
    for r in read_jsonl(out / "reports.jsonl"):
        if "pm_accuracy" in r:  # the last report of a client wins: its final PM
            clients.setdefault(r["client"], {}).update(pm_accuracy=r["pm_accuracy"], test=int(r["pm_test_samples"]))
    for f in sorted((out / "logs").glob("client-*.jsonl")):
        steps = [int(x["steps"]) for x in read_jsonl(f) if x.get("event") == "pm.trained"]
        if steps:
            c = clients.setdefault(f.stem, {})
            c.update(pm_steps_median=statistics.median(steps), pm_steps_min=min(steps), pm_steps_max=max(steps))
    return dict(sorted(clients.items()))


def run_one(name: str, args: list[str], out: Path) -> dict[str, Any]:
    # one process per client (--workers 0): the wall-clock protocol behaviour measured here, and its client logs
    cmd = [sys.executable, "-m", "wafl.cli.main", "run", *args, "--workers", "0", "--out", str(out), "--quiet"]
    print(f"  {name}: {' '.join(cmd[3:])}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: wafl run exited {proc.returncode}\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    final = summary["final"]
    row = {
        "setting": name,
        "args": args,
        "wall_s": summary["wall_s"],
        "elapsed_s": round(time.monotonic() - start, 1),
        "rounds": final["round"],
        "gm_accuracy": final["gm_accuracy"],
        "pm_accuracy": final["pm_accuracy"],
        "clients": per_client(out),
    }
    print(f"    {row['wall_s']:.1f} s, GM {row['gm_accuracy']:.4f}, PM {row['pm_accuracy']:.4f}", flush=True)
    return row


def table(doc: dict[str, Any]) -> str:
    lines = [
        "| rep | setting | wall-clock | GM | PM "
        "| per client: final PM (test samples), PM steps a round median (min-max) |",
        "|---|---|---|---|---|---|",
    ]
    for row in doc["runs"]:
        clients = "; ".join(
            f"{c.split('-')[-1]}: {v['pm_accuracy']:.2f} ({v['test']}), {v['pm_steps_median']:g} "
            f"({v['pm_steps_min']}-{v['pm_steps_max']})"
            for c, v in row["clients"].items()
        )
        lines.append(
            f"| {row['rep']} | {row['setting']} | {row['wall_s']:.1f} s | {row['gm_accuracy']:.4f} "
            f"| {row['pm_accuracy']:.4f} | {clients} |"
        )
    return "\n".join(lines)


def save(doc: dict[str, Any], out: Path, stamp: str) -> None:
    doc["loadavg_after"] = os.getloadavg()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / f"{stamp}.md").write_text(table(doc) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the three runs (default 1)")
    ap.add_argument("--floor", type=int, default=20, help="pm_min_steps of the third setting (default 20)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every run (default: wafl run's)")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"results folder (default {RESULTS})")
    ap.add_argument("--runs", type=Path, default=Path("runs"), help="where the run folders go (default runs/)")
    ap.add_argument("--smoke", action="store_true", help="2 rounds, floor 7: checks the script (what the tests run)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rounds, args.floor = args.rounds or 2, 7
    if args.reps < 1:
        ap.error(f"--reps {args.reps} must be >= 1")
    if args.floor < 1:
        ap.error(f"--floor {args.floor} must be >= 1")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")
    example = EXAMPLE + ([] if args.rounds is None else ["--rounds", str(args.rounds)])
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    runs_dir = args.runs / f"pm-floor-{stamp}"
    doc: dict[str, Any] = {
        "example": example,
        "floor": args.floor,
        "commit": git_commit(),
        "cpu": cpu_name(),
        "started": stamp,
        "loadavg_before": os.getloadavg(),
        "runs": [],
    }
    for rep in range(1, args.reps + 1):
        print(f"repetition {rep}/{args.reps}", flush=True)
        for i, (name, extra) in enumerate(settings(args.floor).items()):
            row = run_one(name, example + extra, runs_dir / f"rep{rep}-{i}")
            doc["runs"].append({"rep": rep, **row})
            save(doc, args.out, stamp)  # after every run: a failure later keeps what was measured
    print(table(doc))
    print(f"saved {args.out / stamp}.json and .md (run folders in {runs_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

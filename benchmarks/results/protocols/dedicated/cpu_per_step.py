"""Per client and protocol, from the clients' logs (``gm.trained`` / ``pm.trained`` lines): the GM
phase's wall-clock and CPU seconds per step, and the CPU it got per wall-clock second; the PM's
steps per round.

A GM phase that takes longer under one protocol either cost more CPU per step (the machine ran
slower, or the step did more work) or got less CPU per wall-clock second (its quota was not
delivered); these two columns tell which.

Usage: python cpu_per_step.py RUN_FOLDER [...]   (folders holding compute-and-wait/ and wait-free/)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def phases(logs: Path, event: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in sorted(logs.glob("client-*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if '"event": "' + event in line]
        out[f.stem] = [r for r in rows if r.get("event") == event]
    return out


def main(folders: list[Path]) -> None:
    print(
        "| run | protocol | client | GM phases | GM s/step wall (median) | GM CPU s/step (median) "
        "| GM CPU per wall s (median) | PM steps per round (median) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for run in folders:
        for proto in ("compute-and-wait", "wait-free"):
            logs = run / proto / "logs"
            if not logs.is_dir():
                continue
            gms, pms = phases(logs, "gm.trained"), phases(logs, "pm.trained")
            for client, rows in gms.items():
                if not rows:
                    continue
                wall = statistics.median(r["wall_s"] / r["steps"] for r in rows)
                cpu = statistics.median(r["process_cpu_s"] / r["steps"] for r in rows)
                frac = statistics.median(r["process_cpu_s"] / r["wall_s"] for r in rows)
                pm = statistics.median(r["steps"] for r in pms.get(client, [])) if pms.get(client) else 0
                print(
                    f"| {run} | {proto} | {client} | {len(rows)} | {wall * 1e3:.1f} ms | {cpu * 1e3:.1f} ms "
                    f"| {frac:.3f} | {pm:g} |"
                )


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])

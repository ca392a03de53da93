"""Per client and protocol, from the clients' logs (``gm.trained`` / ``pm.trained`` lines): the GM
phase's wall-clock and CPU seconds per step, and the CPU it got per wall-clock second; the PM's
steps per round.

A GM phase that takes longer under one protocol either cost more CPU per step (the machine ran
slower, or the step did more work) or got less CPU per wall-clock second (its quota was not
delivered); these two columns tell which. A second table bins every GM phase by how busy the
other clients were meanwhile (the share of its duration the others spent in gm_train or pm_train)
and gives the median CPU per step in each bin: whether a step costs more when the machine is
fuller. A third table puts, per run, the round speedup's share of the ideal next to the ratio
of the slowest GM phase of a round (what the round waits for) and of the GM step's CPU cost
between the two runs, for all clients and per client.

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


def busy_bins(folders: list[Path]) -> None:
    points: list[tuple[float, float]] = []
    for run in folders:
        for proto in ("compute-and-wait", "wait-free"):
            path = run / proto / "timelines.json"
            if not path.is_file():
                continue
            tl = json.loads(path.read_text())
            busy = {
                c: [
                    (t["client_start_unix"] + e["start_s"], t["client_start_unix"] + e["end_s"])
                    for e in t["events"]
                    if e["phase"] in ("gm_train", "pm_train")
                ]
                for c, t in tl.items()
            }
            gms = phases(run / proto / "logs", "gm.trained")
            for c, t in tl.items():
                per_round = {r["round"]: r for r in gms.get(c, []) if r["steps"]}
                for e in t["events"]:
                    if e["phase"] != "gm_train" or e["round"] not in per_round or e["end_s"] <= e["start_s"]:
                        continue
                    s, end = t["client_start_unix"] + e["start_s"], t["client_start_unix"] + e["end_s"]
                    others = sum(max(0.0, min(end, y) - max(s, x)) for c2 in tl if c2 != c for x, y in busy[c2])
                    row = per_round[e["round"]]
                    points.append((others / (end - s) / max(1, len(tl) - 1), row["process_cpu_s"] / row["steps"]))
    print()
    print("| other clients busy during the GM phase | GM phases | GM CPU s/step (median) |")
    print("|---|---|---|")
    for lo, hi in ((0.0, 0.7), (0.7, 0.85), (0.85, 0.95), (0.95, 1.01)):
        v = [cpu for share, cpu in points if lo <= share < hi]
        if v:
            print(f"| {lo:.2f}-{min(hi, 1.0):.2f} | {len(v)} | {statistics.median(v) * 1e3:.1f} ms |")


def runs(folders: list[Path]) -> None:
    print()
    print(
        "| run | round speedup / ideal | slowest GM phase WF / C&W (median over rounds) "
        "| GM CPU s/step WF / C&W, all clients | per client |"
    )
    print("|---|---|---|---|---|")
    for run in folders:
        doc_path = run / "protocols.json"
        if not doc_path.is_file():
            continue
        doc = json.loads(doc_path.read_text())
        per = {proto: phases(run / proto / "logs", "gm.trained") for proto in ("compute-and-wait", "wait-free")}
        caw, wf = per["compute-and-wait"], per["wait-free"]
        if not caw or not wf:
            continue

        def cost(rows: list[dict]) -> float:
            return statistics.median(r["process_cpu_s"] / r["steps"] for r in rows if r["steps"])

        def slowest(by_client: dict[str, list[dict]]) -> float:
            rounds: dict[int, float] = {}
            for rows in by_client.values():
                for r in rows:
                    rounds[r["round"]] = max(rounds.get(r["round"], 0.0), r["wall_s"])
            return statistics.median(rounds.values())

        every = cost([r for v in wf.values() for r in v]) / cost([r for v in caw.values() for r in v])
        clients = " ".join(f"{c[7:]}: {cost(wf[c]) / cost(caw[c]):.2f}" for c in sorted(caw) if wf.get(c) and caw[c])
        print(
            f"| {run} | {doc.get('round_speedup_vs_ideal')} | {slowest(wf) / slowest(caw):.3f} "
            f"| {every:.3f} | {clients} |"
        )


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]])
    busy_bins([Path(a) for a in sys.argv[1:]])
    runs([Path(a) for a in sys.argv[1:]])

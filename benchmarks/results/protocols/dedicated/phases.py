"""Two views of the clients' timelines, per run under a folder (``.../rep<k>/<protocol>/timelines.json``).

* Uploads: for every upload phase, the seconds of other clients' uploads in flight during it, per
  second of this upload (0: alone; 3: all four at once), and its duration. Printed per repetition
  and protocol as the mean overlap, the median and the shortest upload: with the server behind
  one shared link, uploads that overlap take longer.
* PM time: each client's PM training seconds per round (mean over rounds), and its PM accuracy
  per round where the run folder still has ``reports.jsonl``. Under wait-free a client trains its
  PM from its upload until the next broadcast, so the client whose GM phase ends last (the
  largest shard) gets the least.
* PM share: each client's PM seconds per round over its mean round length (from its first GM
  phase to its last event, per GM phase): the share of wall-clock time its PM trains. Wait-free
  gives the last client ``T_comm / (T_GM + T_comm)``, compute-and-wait ``T_PM / (T_GM + T_PM +
  T_comm)``.

Usage: python phases.py [FOLDER]   (default: this folder)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def uploads(timelines: dict) -> list[tuple[str, float, float]]:
    out = []
    for client, t in timelines.items():
        base = t["client_start_unix"]
        out += [(client, base + e["start_s"], base + e["end_s"]) for e in t["events"] if e["phase"] == "upload"]
    return out


def overlap(ups: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """``(overlap, duration)`` of every upload."""
    rows = []
    for client, s, e in ups:
        others = sum(max(0.0, min(e, e2) - max(s, s2)) for c2, s2, e2 in ups if c2 != client)
        rows.append((others / max(e - s, 1e-9), e - s))
    return rows


def pm_seconds(timelines: dict) -> dict[str, float]:
    """Mean PM training seconds per round, per client."""
    out = {}
    for client, t in sorted(timelines.items()):
        per_round: dict[int, float] = {}
        for e in t["events"]:
            if e["phase"] == "pm_train":
                per_round[e["round"]] = per_round.get(e["round"], 0.0) + e["end_s"] - e["start_s"]
        out[client] = statistics.mean(per_round.values()) if per_round else 0.0
    return out


def pm_share(timelines: dict) -> dict[str, float]:
    """Each client's PM training seconds per round over its mean round length."""
    secs = pm_seconds(timelines)
    out = {}
    for client, t in sorted(timelines.items()):
        gms = [e for e in t["events"] if e["phase"] == "gm_train"]
        if not gms:
            continue
        span = max(e["end_s"] for e in t["events"]) - gms[0]["start_s"]
        out[client] = secs[client] / (span / len(gms))
    return out


def pm_curves(reports: Path) -> dict[str, list[float]]:
    """Each client's PM accuracy per round, from ``reports.jsonl``."""
    acc: dict[str, dict[int, float]] = {}
    for line in reports.read_text().splitlines():
        r = json.loads(line)
        if "pm_accuracy" in r:
            acc.setdefault(r["client"], {})[r["round"]] = r["pm_accuracy"]
    return {c: [v[k] for k in sorted(v)] for c, v in sorted(acc.items())}


def main(root: Path) -> None:
    paths = sorted(root.glob("**/rep*/*/timelines.json"))
    print("| run | protocol | uploads | other uploads in flight (mean) | upload s (median) | upload s (min) |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        rows = overlap(uploads(json.loads(path.read_text())))
        if not rows:
            continue
        run = path.parent.parent.relative_to(root)
        print(
            f"| {run} | {path.parent.name} | {len(rows)} | {statistics.mean(o for o, _ in rows):.2f} "
            f"| {statistics.median(d for _, d in rows):.3f} | {min(d for _, d in rows):.3f} |"
        )

    print()
    print("| run | protocol | PM s per round, per client | PM accuracy per round, per client (reports.jsonl kept) |")
    print("|---|---|---|---|")
    for path in paths:
        t = json.loads(path.read_text())
        secs = " ".join(f"{c}: {s:.2f}" for c, s in pm_seconds(t).items())
        reports = path.parent / "reports.jsonl"
        curves = ""
        if reports.is_file():
            curves = "<br>".join(f"{c}: " + " ".join(f"{a:.2f}" for a in v) for c, v in pm_curves(reports).items())
        print(f"| {path.parent.parent.relative_to(root)} | {path.parent.name} | {secs} | {curves} |")

    print()
    print("| run | protocol | PM share of wall-clock time, per client |")
    print("|---|---|---|")
    for path in paths:
        shares = " ".join(f"{c}: {s:.2f}" for c, s in pm_share(json.loads(path.read_text())).items())
        print(f"| {path.parent.parent.relative_to(root)} | {path.parent.name} | {shares} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)

"""Statistics of a run's records: phase durations and shares of the clients' wall time, the
communication time, the ideal speedup, the PM accuracy over wall-clock and the time to a target."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from wafl.cli.report.run_records import Timelines, timeline_events

COMM_DEFINITION = (
    "t_comm_s = median over rounds r of min over clients i of (arrival_i(r+1) - upload_start_i(r)), "
    "where upload_start_i(r) is the start of client i's upload phase of round r and arrival_i(r+1) the end of "
    "its idle phase of round r (the moment the complete next broadcast had been received). The minimum picks "
    "the round's last uploader, whose span holds no waiting for stragglers: its upload, the server's "
    "aggregation, evaluation and checkpoint, and the broadcast's transfer."
)


IDEAL_DEFINITION = (
    "(t_gm_s + t_pm_s + t_comm_s) / (t_gm_s + t_comm_s), medians of the compute-and-wait run "
    "(t_pm_s: pm_train under compute-and-wait)"
)


def median(values: Iterable[float]) -> float | None:
    """Median of ``values``, ``None`` when there are none."""
    vals = [float(v) for v in values]
    return statistics.median(vals) if vals else None


def cpu_per_step(phases: Iterable[Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """Medians over training phases of the process CPU seconds per step and per wall-clock second.

    A phase that took longer in one run than in another either cost more CPU per step (the machine
    ran slower) or got less CPU per wall-clock second (its share was not delivered)."""
    ok = [p for p in phases if p.get("steps") and p.get("wall_s") and p.get("process_cpu_s") is not None]
    return (
        median(float(p["process_cpu_s"]) / int(p["steps"]) for p in ok),
        median(float(p["process_cpu_s"]) / float(p["wall_s"]) for p in ok),
    )


def phase_durations(timelines: Timelines, phase: str) -> list[float]:
    """Durations of every ``phase`` event of every client, in client then time order."""
    return [
        float(e["end_s"]) - float(e["start_s"])
        for tl in timelines.values()
        for e in timeline_events(tl)
        if e["phase"] == phase
    ]


def share_of_wall(timelines: Timelines, part: Callable[[list[Mapping[str, Any]]], float]) -> float | None:
    """``sum(part(events))`` over clients / sum of client wall times (first phase start to last phase end)."""
    num = 0.0
    wall = 0.0
    for tl in timelines.values():
        ev = timeline_events(tl)
        if ev:
            wall += max(float(e["end_s"]) for e in ev) - min(float(e["start_s"]) for e in ev)
            num += part(ev)
    return num / wall if wall > 0 else None


def idle_fraction(timelines: Timelines) -> float | None:
    """Sum of idle durations / sum of client wall times."""
    return share_of_wall(
        timelines, lambda ev: sum(float(e["end_s"]) - float(e["start_s"]) for e in ev if e["phase"] == "idle")
    )


def _gaps(ev: list[Mapping[str, Any]]) -> float:
    """Time between the first start and the last end that no phase covers (events in start order)."""
    gaps = 0.0
    covered_to = float(ev[0]["start_s"])
    for e in ev:
        start, end = float(e["start_s"]), float(e["end_s"])
        if start > covered_to:
            gaps += start - covered_to
        covered_to = max(covered_to, end)
    return gaps


def untracked_fraction(timelines: Timelines) -> float | None:
    """Client wall time covered by no phase at all (neither compute, upload, idle nor evaluation) / client wall time."""
    return share_of_wall(timelines, _gaps)


def comm_durations(timelines: Timelines) -> list[float]:
    """Per round (in round order), the communication time of its last uploader; see ``COMM_DEFINITION``."""
    per_round: dict[int, list[float]] = {}
    for tl in timelines.values():
        ev = timeline_events(tl)
        uploads = {int(e["round"]): float(e["start_s"]) for e in ev if e["phase"] == "upload"}
        arrivals = {int(e["round"]): float(e["end_s"]) for e in ev if e["phase"] == "idle"}
        for r, start in uploads.items():
            if r in arrivals:
                per_round.setdefault(r, []).append(arrivals[r] - start)
    return [min(v) for _, v in sorted(per_round.items())]


def ideal_speedup(t_gm: float | None, t_pm: float | None, t_comm: float | None) -> float | None:
    """``(T_GM + T_PM + T_comm) / (T_GM + T_comm)``; ``None`` when a term is unknown."""
    if t_gm is None or t_pm is None or t_comm is None or t_gm + t_comm <= 0:
        return None
    return (t_gm + t_pm + t_comm) / (t_gm + t_comm)


def training_start(rows: Sequence[Mapping[str, Any]]) -> float:
    """Server time (seconds since the server started) at which round 1 opened."""
    if not rows:
        return 0.0
    first = rows[0]
    return float(first["wall_s"]) - float(first.get("round_s") or 0.0)


def pm_accuracy_curve(
    reports: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]] = ()
) -> list[tuple[float, float]]:
    """``[(t_s, pm_accuracy)]`` on the server clock, one point per PM report.

    At each report the value is the ``pm_test_samples``-weighted mean of every client's latest
    ``pm_accuracy``; points start once every client that reports a PM accuracy has done so.
    Runs whose PM accuracies arrive with the uploads instead (no PM reports) fall back to the
    per-round ``pm_accuracy`` of ``results.jsonl`` at each round's close.
    """
    pm = [r for r in reports if r.get("pm_accuracy") is not None]
    if not pm:
        return [(float(r["wall_s"]), float(r["pm_accuracy"])) for r in rows if r.get("pm_accuracy") is not None]
    clients = {r["client"] for r in pm}
    latest: dict[str, tuple[float, float]] = {}
    curve: list[tuple[float, float]] = []
    for r in sorted(pm, key=lambda r: float(r["t_s"])):
        latest[r["client"]] = (float(r["pm_accuracy"]), float(r.get("pm_test_samples") or 1.0))
        if len(latest) < len(clients):
            continue
        n = sum(k for _, k in latest.values())
        if n > 0:
            curve.append((float(r["t_s"]), sum(a * k for a, k in latest.values()) / n))
    return curve


def zeta_total(curve: Sequence[tuple[float, float]], target: float, t0: float = 0.0) -> float | None:
    """Seconds after ``t0`` at which ``curve`` first reaches ``target``; ``None`` if it never does."""
    for t, acc in curve:
        if acc >= target - 1e-12:
            return max(0.0, t - t0)
    return None


def rounded(v: float | None, digits: int = 4) -> float | None:
    """``v`` rounded for a JSON record; ``None`` when unknown or not finite."""
    return None if v is None or not math.isfinite(v) else round(float(v), digits)

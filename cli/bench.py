"""``wafl bench protocols``: wait-free against compute-and-wait, same algorithm, seeds and config.

Both protocols run as real federations (``wafl.cli.launch``: a server and N client processes,
optionally behind shaped links), one after the other, into ``OUT/compute-and-wait`` and
``OUT/wait-free``. ``OUT/protocols.json`` then holds, per protocol:

* ``total_s``: server wall-clock from the opening of round 1 (every client has joined) to the
  close of the last round; process start-up and joining are excluded;
* ``rounds`` and ``round_s`` (median of the server's per-round durations);
* ``idle_fraction``: sum of the clients' ``idle`` phases / sum of the clients' wall time, a
  client's wall time running from the start of its first phase to the end of its last;
* ``zeta_total_s``: seconds from the opening of round 1 until the PM accuracy first reaches
  ``target`` (``null`` if it never does). The PM accuracy at server time ``t`` is the mean of
  every client's latest ``pm_accuracy`` report, weighted by ``pm_test_samples``; it is defined
  once every reporting client has reported at least once;
* ``untracked_fraction``: client wall time inside no phase at all (e.g. a report awaited
  between rounds) / client wall time, so that waiting the phases do not name is not hidden;
* the median phase durations ``t_gm_s``, ``t_pm_s``, ``t_upload_s``, ``t_comm_s`` (see
  :func:`comm_durations`);

``zeta_by_target_s`` repeats ``zeta_total_s`` for a few fixed targets; ``first_round_s`` and
``later_round_s`` (median of rounds 2..) separate the first round, which carries every client
process's one-off start-up costs, from the steady state. Compute-and-wait runs first, for
``rounds``; wait-free then runs for ``ceil(rounds x ideal speedup)`` rounds (``same_rounds``:
``rounds`` too), the rounds that fit in compute-and-wait's time at the ideal speedup: a
protocol whose rounds are shorter is not cut off sooner, so a time to the target that
compute-and-wait reaches within its time is not lost to wait-free's shorter run. The top level
holds ``speedup`` = compute-and-wait ``total_s`` per round / wait-free ``total_s`` per round,
``round_speedup`` (the same for the median ``round_s``), the ideal speedup
``(T_GM + T_PM + T_comm) / (T_GM + T_comm)`` from the compute-and-wait run's medians, and
``speedup_vs_ideal`` = speedup / ideal (``round_speedup_vs_ideal`` the same for the round
speedup). Each host runs with its own CPU share (``host_cpus``; see :func:`bench_protocols`).
``OUT/timelines.png`` draws every client's phases under
both protocols (the paper's Fig. 2), ``OUT/pm_accuracy.png`` the PM accuracy against
wall-clock. The runs' model files (``checkpoint.pt``, ``clients/``) are deleted afterwards;
their records (``results.jsonl``, ``reports.jsonl``, ``timelines.json``, ``logs/``) stay.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from wafl.common.config import RunConfig
from wafl.common.contract import PROTOCOLS

PROTOCOL_ORDER = PROTOCOLS[::-1]  # the baseline, compute-and-wait, first
PHASE_COLORS = {
    "gm_train": "tab:blue",
    "pm_train": "tab:orange",
    "upload": "tab:green",
    "evaluate": "tab:purple",
    "idle": "tab:red",
}
COMM_DEFINITION = (
    "t_comm_s = median over rounds r of min over clients i of (arrival_i(r+1) - upload_start_i(r)), "
    "where upload_start_i(r) is the start of client i's upload phase of round r and arrival_i(r+1) the end of "
    "its idle phase of round r (the moment the complete next broadcast had been received). The minimum picks "
    "the round's last uploader, whose span holds no waiting for stragglers: its upload, the server's "
    "aggregation, evaluation and checkpoint, and the broadcast's transfer."
)
ZETA_TARGETS = (0.5, 0.6, 0.7, 0.8, 0.9)
IDEAL_DEFINITION = (
    "(t_gm_s + t_pm_s + t_comm_s) / (t_gm_s + t_comm_s), medians of the compute-and-wait run "
    "(t_pm_s: pm_train under compute-and-wait)"
)

Timelines = Mapping[str, Mapping[str, Any]]


# ----------------------------------------------------------------------------- reading a run
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` (``[]`` when missing)."""
    if not path.exists():
        return []
    rows: list[dict[str, Any]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def read_timelines(path: Path) -> dict[str, Any]:
    """``timelines.json`` of a run (``{}`` when missing)."""
    return json.loads(path.read_text()) if path.exists() else {}


def trained_phases(logs: Path, event: str = "gm.trained") -> list[dict[str, Any]]:
    """Every client's ``gm.trained`` (or ``pm.trained``) log lines: steps, wall-clock and process CPU seconds."""
    return [r for f in sorted(logs.glob("client-*.jsonl")) for r in read_jsonl(f) if r.get("event") == event]


def cpu_per_step(phases: Iterable[Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """Medians over training phases of the process CPU seconds per step and per wall-clock second.

    A phase that took longer in one run than in another either cost more CPU per step (the machine
    ran slower) or got less CPU per wall-clock second (its share was not delivered)."""
    ok = [p for p in phases if p.get("steps") and p.get("wall_s") and p.get("process_cpu_s") is not None]
    return (
        median(float(p["process_cpu_s"]) / int(p["steps"]) for p in ok),
        median(float(p["process_cpu_s"]) / float(p["wall_s"]) for p in ok),
    )


def _events(timeline: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return sorted(timeline.get("events", []), key=lambda e: (e["start_s"], e["end_s"]))


def git_commit() -> str | None:
    """The commit of the code being measured (recorded in every benchmark's JSON), None outside a clone."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ----------------------------------------------------------------------------- statistics
def median(values: Iterable[float]) -> float | None:
    """Median of ``values``, ``None`` when there are none."""
    vals = [float(v) for v in values]
    return statistics.median(vals) if vals else None


def phase_durations(timelines: Timelines, phase: str) -> list[float]:
    """Durations of every ``phase`` event of every client, in client then time order."""
    return [
        float(e["end_s"]) - float(e["start_s"]) for tl in timelines.values() for e in _events(tl) if e["phase"] == phase
    ]


def _share_of_wall(timelines: Timelines, part: Callable[[list[Mapping[str, Any]]], float]) -> float | None:
    """``sum(part(events))`` over clients / sum of client wall times (first phase start to last phase end)."""
    num = 0.0
    wall = 0.0
    for tl in timelines.values():
        ev = _events(tl)
        if ev:
            wall += max(float(e["end_s"]) for e in ev) - min(float(e["start_s"]) for e in ev)
            num += part(ev)
    return num / wall if wall > 0 else None


def idle_fraction(timelines: Timelines) -> float | None:
    """Sum of idle durations / sum of client wall times."""
    return _share_of_wall(
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
    return _share_of_wall(timelines, _gaps)


def comm_durations(timelines: Timelines) -> list[float]:
    """Per round (in round order), the communication time of its last uploader; see ``COMM_DEFINITION``."""
    per_round: dict[int, list[float]] = {}
    for tl in timelines.values():
        ev = _events(tl)
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


def _r(v: float | None, digits: int = 4) -> float | None:
    return None if v is None or not math.isfinite(v) else round(float(v), digits)


def summarize_run(out_dir: Path, target: float) -> dict[str, Any]:
    """The ``protocols.json`` entry of one finished run in ``out_dir``."""
    rows = read_jsonl(out_dir / "results.jsonl")
    reports = read_jsonl(out_dir / "reports.jsonl")
    timelines = read_timelines(out_dir / "timelines.json")
    t0 = training_start(rows)
    curve = pm_accuracy_curve(reports, rows)
    t_gm = median(phase_durations(timelines, "gm_train"))
    t_pm = median(phase_durations(timelines, "pm_train"))
    t_up = median(phase_durations(timelines, "upload"))
    t_comm = median(comm_durations(timelines))
    idle = sum(phase_durations(timelines, "idle"))
    gm_cpu_step, gm_cpu_wall = cpu_per_step(trained_phases(out_dir / "logs"))
    return {
        "total_s": _r(float(rows[-1]["wall_s"]) - t0) if rows else None,
        "rounds": len(rows),
        "round_s": _r(median(float(r["round_s"]) for r in rows if r.get("round_s") is not None)),
        "idle_fraction": _r(idle_fraction(timelines), 5),
        "idle_s": _r(idle),
        "untracked_fraction": _r(untracked_fraction(timelines), 5),
        "zeta_total_s": _r(zeta_total(curve, target, t0)),
        "zeta_by_target_s": {f"{x:g}": _r(zeta_total(curve, x, t0)) for x in sorted({*ZETA_TARGETS, target})},
        "first_round_s": _r(float(rows[0]["round_s"])) if rows and rows[0].get("round_s") is not None else None,
        "later_round_s": _r(median(float(r["round_s"]) for r in rows[1:] if r.get("round_s") is not None)),
        "t_gm_s": _r(t_gm),
        "t_pm_s": _r(t_pm),
        "t_upload_s": _r(t_up),
        "t_comm_s": _r(t_comm),
        "gm_cpu_per_step_s": _r(gm_cpu_step, 5),
        "gm_cpu_per_wall_s": _r(gm_cpu_wall),
        "final_gm_accuracy": rows[-1].get("gm_accuracy") if rows else None,
        "final_pm_accuracy": _r(curve[-1][1]) if curve else None,
        "best_pm_accuracy": _r(max(a for _, a in curve)) if curve else None,
        "start_s": _r(t0),
        "clients": len(timelines),
        "out": str(out_dir),
    }


def equal_time_rounds(rounds: int, caw: Mapping[str, Any]) -> int:
    """The wait-free rounds that fit in compute-and-wait's time at the ideal speedup (``rounds``
    when the compute-and-wait run gave no phase medians)."""
    ideal = ideal_speedup(caw.get("t_gm_s"), caw.get("t_pm_s"), caw.get("t_comm_s"))
    return max(rounds, math.ceil(rounds * ideal)) if ideal else rounds


def compare(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``speedup``, the ideal speedup and ``speedup_vs_ideal`` from the two protocols' entries."""
    caw, wf = results.get("compute-and-wait", {}), results.get("wait-free", {})
    speedup = None
    if caw.get("total_s") and wf.get("total_s") and caw.get("rounds") and wf.get("rounds"):
        speedup = (caw["total_s"] / caw["rounds"]) / (wf["total_s"] / wf["rounds"])
    ideal = ideal_speedup(caw.get("t_gm_s"), caw.get("t_pm_s"), caw.get("t_comm_s"))
    zeta_speedup = None
    if caw.get("zeta_total_s") and wf.get("zeta_total_s"):
        zeta_speedup = caw["zeta_total_s"] / wf["zeta_total_s"]
    round_speedup = None
    if caw.get("round_s") and wf.get("round_s"):
        round_speedup = caw["round_s"] / wf["round_s"]
    cpu_ratio = None
    if caw.get("gm_cpu_per_step_s") and wf.get("gm_cpu_per_step_s"):
        cpu_ratio = wf["gm_cpu_per_step_s"] / caw["gm_cpu_per_step_s"]
    return {
        "speedup": _r(speedup),
        "round_speedup": _r(round_speedup),
        "ideal_speedup": _r(ideal),
        "speedup_vs_ideal": _r(speedup / ideal) if speedup is not None and ideal else None,
        "round_speedup_vs_ideal": _r(round_speedup / ideal) if round_speedup is not None and ideal else None,
        "zeta_speedup": _r(zeta_speedup),
        # the machine's speed during the two runs: > 1 when a GM step cost the wait-free run more CPU
        "gm_cpu_per_step_ratio": _r(cpu_ratio),
        "ideal_definition": IDEAL_DEFINITION,
        "t_comm_definition": COMM_DEFINITION,
    }


# ----------------------------------------------------------------------------- pictures
def _aligned(timelines: Timelines) -> tuple[list[str], dict[str, list[tuple[str, int, float, float]]]]:
    """Every client's events on one clock: seconds since the earliest first phase of any client."""
    clients = sorted(timelines, key=lambda c: (len(c), c))
    starts = {c: float(timelines[c].get("client_start_unix") or 0.0) for c in clients}
    firsts = [starts[c] + float(_events(timelines[c])[0]["start_s"]) for c in clients if _events(timelines[c])]
    base = min(firsts) if firsts else 0.0
    out = {
        c: [
            (e["phase"], int(e["round"]), starts[c] + float(e["start_s"]) - base, starts[c] + float(e["end_s"]) - base)
            for e in _events(timelines[c])
        ]
        for c in clients
    }
    return clients, out


def plot_timelines(runs: Mapping[str, Timelines], path: Path, title: str = "") -> None:
    """A Gantt chart per protocol: per client, compute phases on the upper lane, uploads below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [p for p in PROTOCOL_ORDER if p in runs] + [p for p in runs if p not in PROTOCOL_ORDER]
    n_clients = max((len(runs[p]) for p in names), default=1)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(12, 1.0 + 0.55 * n_clients * len(names) + 0.6 * len(names)), sharex=True, squeeze=False
    )
    for ax, name in zip(axes[:, 0], names):
        clients, events = _aligned(runs[name])
        for row, c in enumerate(clients):
            y = len(clients) - 1 - row
            for phase, _rnd, s, e in events[c]:
                if phase == "upload":
                    ax.broken_barh([(s, max(e - s, 1e-3))], (y - 0.42, 0.3), facecolors=PHASE_COLORS[phase])
                else:
                    ax.broken_barh(
                        [(s, max(e - s, 1e-3))],
                        (y - 0.08, 0.5),
                        facecolors=PHASE_COLORS.get(phase, "grey"),
                        edgecolor="white",
                        linewidth=0.3,
                    )
        ax.set_yticks(range(len(clients)))
        ax.set_yticklabels(list(reversed(clients)))
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("wall-clock (s since the first client phase)")
    handles = [Patch(color=c, label=p) for p, c in PHASE_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8)
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pm_accuracy(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: Path,
    target: float | None = None,
    zetas: Mapping[str, float | None] | None = None,
    title: str = "",
) -> None:
    """PM accuracy (test-size-weighted mean of the latest reports) against wall-clock, per protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in curves.items():
        if curve:
            ts, accs = zip(*curve)
            line = ax.step(ts, accs, where="post", marker="o", ms=3, label=name)[0]
            z = (zetas or {}).get(name)
            if z is not None:
                ax.axvline(z, color=line.get_color(), ls=":", lw=1)
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xlabel("wall-clock since round 1 opened (s)")
    ax.set_ylabel("PM accuracy (local test sets)")
    save_plot(fig, ax, path, title)


def save_plot(fig: Any, ax: Any, path: Path, title: str = "") -> None:
    """Title, grid and legend on ``ax``, then ``fig`` written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- the command
def launch_measured(
    run_cfg: RunConfig,
    run_dir: Path,
    link_rate: str | None,
    show_progress: bool,
    timeout_s: float,
    host_cpus: str | None,
) -> tuple[Any, dict[str, Any]]:
    """One federation of a benchmark (``wafl.cli.launch``): every host with its CPU share
    (``host_cpus``; None: ``auto`` where control groups can be used, else shared cores with a
    warning); returns the launcher's summary and the machine's load average before and after.
    Model files are removed afterwards (weights are not a measurement)."""
    from wafl.cli.launcher import launch

    before = os.getloadavg()
    summary = launch(
        run_cfg,
        run_dir,
        link_rate=link_rate,
        show_progress=show_progress,
        timeout_s=timeout_s,
        host_cpus=host_cpus or "auto",
        quota_optional=host_cpus is None,
    )
    after = os.getloadavg()
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "clients", ignore_errors=True)
    load = {"before_1m": round(before[0], 2), "after_1m": round(after[0], 2), "after_5m": round(after[1], 2)}
    return summary, {**load, "cpus": os.cpu_count()}


def bench_protocols(
    cfg: RunConfig,
    out: Path,
    link_rate: str | None = None,
    target: float = 0.9,
    show_progress: bool = True,
    timeout_s: float = 3600.0,
    host_cpus: str | None = None,
    same_rounds: bool = False,
) -> int:
    """Runs ``cfg`` under both protocols; writes ``protocols.json`` and the two PNGs; 0 when both runs finished.

    ``host_cpus``: every host's CPU share (``wafl run --host-cpus``); None: ``auto`` (the cores
    split evenly between the server and the clients) where control groups can be used, else a
    warning and shared cores. Each protocol's entry records the shares, the quotas read back
    from the groups and the CPU each process used (``host_cpus``).
    """

    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    timelines: dict[str, Any] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    ok = True
    rounds = {p: cfg.rounds for p in PROTOCOL_ORDER}
    for i, protocol in enumerate(PROTOCOL_ORDER, 1):
        if protocol == "wait-free" and not same_rounds:
            rounds[protocol] = equal_time_rounds(cfg.rounds, results.get("compute-and-wait", {}))
        run_cfg = dataclasses.replace(cfg, protocol=protocol, params=dict(cfg.params), rounds=rounds[protocol])
        run_dir = out / protocol
        shutil.rmtree(run_dir / "clients", ignore_errors=True)  # no PM state of an earlier run
        if show_progress:
            print(
                f"[{i}/{len(PROTOCOL_ORDER)}] {protocol}: {cfg.algorithm}, {cfg.dataset}, {cfg.num_clients} "
                f"clients, {rounds[protocol]} rounds" + (f", links {link_rate}" if link_rate else ""),
                file=sys.stderr,
                flush=True,
            )
        summary, load = launch_measured(run_cfg, run_dir, link_rate, show_progress, timeout_s, host_cpus)
        ok = ok and summary.ok
        entry = summarize_run(run_dir, target)
        entry["ok"] = summary.ok
        entry["host_cpus"] = summary.host_cpus
        entry["host_load_avg"] = load
        results[protocol] = entry
        timelines[protocol] = read_timelines(run_dir / "timelines.json")
        t0 = training_start(read_jsonl(run_dir / "results.jsonl"))
        curves[protocol] = [
            (t - t0, a)
            for t, a in pm_accuracy_curve(read_jsonl(run_dir / "reports.jsonl"), read_jsonl(run_dir / "results.jsonl"))
        ]
    doc = {
        "commit": git_commit(),
        "config": {
            "algorithm": cfg.algorithm,
            "dataset": cfg.dataset,
            "num_clients": cfg.num_clients,
            "rounds": cfg.rounds,
            "rounds_per_protocol": rounds,
            "same_rounds": same_rounds,
            "local_epochs": cfg.local_epochs,
            "pm_epochs": cfg.pm_epochs,
            "pm_min_steps": cfg.pm_min_steps,
            "pm_max_epochs": cfg.pm_max_epochs,
            "pm_nice": cfg.pm_nice,
            "batch_size": cfg.batch_size,
            "partition": cfg.partition,
            "alpha": cfg.alpha,
            "seed": cfg.seed,
            "params": cfg.params,
            "link_rate": link_rate,
            "host_cpus": host_cpus or "auto",
            "target": target,
        },
        "protocols": results,
        **compare(results),
    }
    (out / "protocols.json").write_text(json.dumps(doc, indent=2) + "\n")
    title = f"{cfg.algorithm}, {cfg.dataset}, {cfg.num_clients} clients" + (
        f", {link_rate} links" if link_rate else ", loopback"
    )
    plot_timelines(timelines, out / "timelines.png", title)
    plot_pm_accuracy(curves, out / "pm_accuracy.png", target, {p: results[p]["zeta_total_s"] for p in results}, title)
    if show_progress:
        print(format_table(doc), file=sys.stderr)
    return 0 if ok else 1


def format_table(doc: Mapping[str, Any]) -> str:
    """A short text summary of ``protocols.json``."""
    keys = (
        "total_s",
        "rounds",
        "round_s",
        "idle_fraction",
        "zeta_total_s",
        "t_gm_s",
        "t_pm_s",
        "t_comm_s",
        "gm_cpu_per_step_s",
        "gm_cpu_per_wall_s",
        "best_pm_accuracy",
    )
    protos = list(doc["protocols"])
    lines = [f"{'':<18}" + "".join(f"{p:>18}" for p in protos)]
    for k in keys:
        lines.append(f"{k:<18}" + "".join(f"{_fmt(doc['protocols'][p].get(k)):>18}" for p in protos))
    lines.append(
        f"{'cpu used / quota':<18}"
        + "".join(f"{_cpu_summary(doc['protocols'][p].get('host_cpus')):>18}" for p in protos)
    )
    for k in (
        "speedup",
        "round_speedup",
        "ideal_speedup",
        "speedup_vs_ideal",
        "round_speedup_vs_ideal",
        "zeta_speedup",
        "gm_cpu_per_step_ratio",
    ):
        lines.append(f"{k:<18}{_fmt(doc.get(k)):>18}")
    return "\n".join(lines)


def _cpu_summary(host_cpus: Mapping[str, Any] | None) -> str:
    """``"0.31/0.40"``: the mean over hosts of the CPU used per wall-clock second, and of the quota."""
    hosts = (host_cpus or {}).get("hosts") or {}
    used = [h["cpu_fraction"] for h in hosts.values() if h.get("cpu_fraction") is not None]
    quota = [h["quota_cpus"] for h in hosts.values() if h.get("quota_cpus") is not None]
    if not quota:
        return "shared"
    return f"{statistics.mean(used) if used else float('nan'):.2f}/{statistics.mean(quota):.2f}"


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

"""``wafl bench async``: synchronous against buffered aggregation on heterogeneous clients.

The same federation (``wafl.cli.launch``: a server and N client processes, optionally behind
shaped links) runs four times, into ``OUT/<aggregation>-<protocol>``: sync and buffered
aggregation, each with wait-free and with compute-and-wait clients. Buffered runs publish
``versions_factor`` times ``E = rounds * N / buffer_size`` versions: ``E`` versions hold as many
client updates as sync's ``rounds``, the rest let buffered run about as long as sync does.
``OUT/async.json`` holds per run:

* ``time_to_target_s``: seconds from the first model's publication (every client joined) until
  the global model's test accuracy first reaches ``target`` (``null`` if it never does);
* ``final_gm_accuracy``, ``best_gm_accuracy``, ``total_s`` (first publication to last version),
  ``versions`` and, for buffered runs, the mean and maximum staleness of the updates;
* for buffered runs, ``gm_at_equal_updates`` (the accuracy of version ``E``: as many client
  updates as the sync run) and ``gm_at_sync_time`` (of the last version published within the
  same-protocol sync run's ``total_s``: the same wall-clock budget);
* ``idle_fraction`` (clients' ``idle`` time / their wall time, as in ``wafl bench protocols``),
  ``slowdown_fraction`` and ``offline_fraction`` (the same for those phases);

and at the top level, per protocol, ``speedup_to_target`` = sync's time to target / buffered's,
``final_difference_equal_updates`` and ``final_difference_equal_time`` = buffered's accuracy at
equal updates / at equal wall-clock - sync's final accuracy (in accuracy units), and whether the
target holds (``speedup_to_target >= 1.5`` and a difference of at least -0.01) for each budget.
``OUT/accuracy.png`` draws GM accuracy against wall-clock for the four runs, ``OUT/timelines.png``
every client's phases. Model files are deleted afterwards; records and logs stay.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wafl.cli.launch.hosts import Hosts
from wafl.cli.launch.measured import launch_measured, measured_hosts
from wafl.cli.report.bench_plots import plot_timelines, save_plot
from wafl.cli.report.provenance import git_commit
from wafl.cli.report.run_records import read_jsonl, read_timelines
from wafl.cli.report.text_columns import key_lines
from wafl.cli.report.timeline_stats import idle_fraction, rounded, share_of_wall, training_start
from wafl.common.config import RunConfig
from wafl.common.contract import ClientProtocol
from wafl.server.strategies import check_aggregation
from wafl.server.strategies.buffered import BufferedConfig

AGGREGATIONS = ("sync", "buffered")
PROTOCOLS = (ClientProtocol.COMPUTE_AND_WAIT, ClientProtocol.WAIT_FREE)  # the baseline first


def _phase_fraction(timelines: Mapping[str, Any], phase: str) -> float | None:
    return share_of_wall(
        timelines, lambda ev: sum(float(e["end_s"]) - float(e["start_s"]) for e in ev if e["phase"] == phase)
    )


def accuracy_curve(rows: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """``[(seconds since the first publication, gm_accuracy)]``, one point per evaluated version."""
    t0 = training_start(rows)
    return [(float(r["wall_s"]) - t0, float(r["gm_accuracy"])) for r in rows if r.get("gm_accuracy") is not None]


def time_to(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    return next((t for t, a in curve if a >= target - 1e-12), None)


def accuracy_at(curve: Sequence[tuple[float, float]], seconds: float) -> float | None:
    """The accuracy of the last version published within ``seconds`` (None before the first)."""
    reached = [a for t, a in curve if t <= seconds + 1e-9]
    return reached[-1] if reached else None


def summarize(
    run_dir: Path, target: float, equal_updates: int | None = None, sync_total_s: float | None = None
) -> dict[str, Any]:
    """One run's figures; ``equal_updates`` / ``sync_total_s`` (buffered runs): the version with as
    many client updates as the sync run, and the sync run's wall-clock, at which its accuracy is read."""
    rows = read_jsonl(run_dir / "results.jsonl")
    timelines = read_timelines(run_dir / "timelines.json")
    curve = accuracy_curve(rows)
    stale = [r["staleness_mean"] for r in rows if r.get("staleness_mean") is not None]
    budgets: dict[str, Any] = {}
    if equal_updates is not None:
        at = [r["gm_accuracy"] for r in rows if r.get("round") == equal_updates and r.get("gm_accuracy") is not None]
        budgets["gm_at_equal_updates"] = rounded(at[0] if at else None)
    if sync_total_s is not None:
        budgets["gm_at_sync_time"] = rounded(accuracy_at(curve, sync_total_s))
    return {
        "versions": len(rows),
        "total_s": rounded(curve[-1][0] if curve else None, 3),
        "time_to_target_s": rounded(time_to(curve, target), 3),
        "final_gm_accuracy": rounded(curve[-1][1] if curve else None),
        "best_gm_accuracy": rounded(max((a for _, a in curve), default=None)),
        "idle_fraction": rounded(idle_fraction(timelines)),
        "slowdown_fraction": rounded(_phase_fraction(timelines, "slowdown")),
        "offline_fraction": rounded(_phase_fraction(timelines, "offline")),
        "staleness_mean": rounded(sum(stale) / len(stale) if stale else None),
        "staleness_max": max((r["staleness_max"] for r in rows if r.get("staleness_max") is not None), default=None),
        **budgets,
        "curve": [(rounded(t, 3), rounded(a)) for t, a in curve],
    }


def compare(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in PROTOCOLS:
        s, b = runs.get(f"sync-{p}"), runs.get(f"buffered-{p}")
        if s is None or b is None:
            continue
        ts, tb = s["time_to_target_s"], b["time_to_target_s"]
        fs = s["final_gm_accuracy"]
        speedup = rounded(ts / tb) if ts is not None and tb else None
        entry: dict[str, Any] = {"speedup_to_target": speedup}
        for budget, key in (("equal_updates", "gm_at_equal_updates"), ("equal_time", "gm_at_sync_time")):
            fb = b.get(key)
            diff = rounded(fb - fs) if fs is not None and fb is not None else None
            entry[f"final_difference_{budget}"] = diff
            met = speedup is not None and speedup >= 1.5 and diff is not None and diff >= -0.01
            entry[f"target_met_{budget}"] = met
        out[p] = entry
    return out


def plot_accuracy(curves: Mapping[str, Sequence[tuple[float, float]]], path: Path, target: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"sync": "-", "buffered": "--"}
    for name, curve in curves.items():
        if curve:
            ax.plot(*zip(*curve), styles[name.split("-")[0]], marker="o", ms=2.5, label=name)
    ax.axhline(target, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("wall-clock (s since the first model was published)")
    ax.set_ylabel("GM accuracy (global test set)")
    save_plot(fig, ax, path, title)


def bench_async(
    cfg: RunConfig,
    out: Path,
    hosts: Hosts | None = None,
    target: float = 0.9,
    show_progress: bool = True,
    timeout_s: float = 3600.0,
    versions_factor: int = 5,
) -> int:
    """Runs the four federations; writes ``async.json`` and the PNGs; 0 when every run finished.

    ``hosts``: the links and every host's CPU share, as in :func:`wafl.cli.experiments.bench.bench_protocols`
    (None: loopback, ``auto`` shares where control groups can be used, else shared cores with a warning).
    Under quotas a client's slow-down divides its share instead of adding sleeps.
    """
    hosts = hosts or measured_hosts(cfg)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    timelines: dict[str, Any] = {}
    ok = True
    plan = [(a, p) for a in AGGREGATIONS for p in PROTOCOLS]
    for i, (aggregation, protocol) in enumerate(plan, 1):
        name = f"{aggregation}-{protocol}"
        rounds, equal = cfg.federation.rounds, None
        if aggregation == "buffered":
            probe = copy.deepcopy(cfg)
            probe.rule.aggregation = "buffered"
            check_aggregation(probe.validate())
            equal = math.ceil(cfg.federation.rounds * cfg.federation.num_clients / BufferedConfig.of(probe).buffer_size)
            rounds = equal * versions_factor
        run_cfg = copy.deepcopy(cfg)
        run_cfg.rule.aggregation, run_cfg.client.protocol, run_cfg.federation.rounds = aggregation, protocol, rounds
        check_aggregation(run_cfg.validate())
        run_dir = out / name
        if show_progress:
            print(
                f"[{i}/{len(plan)}] {name}: {cfg.training.algorithm}, {cfg.federation.num_clients} clients, "
                f"{rounds} versions",
                file=sys.stderr,
            )
        summary, load = launch_measured(run_cfg, run_dir, hosts, show_progress, timeout_s)
        ok = ok and summary.ok
        runs[name] = {
            "ok": summary.ok,
            "rounds_configured": rounds,
            "host_load_avg": load,
            "host_cpus": summary.host_cpus,
            **summarize(
                run_dir,
                target,
                equal_updates=equal,
                sync_total_s=runs.get(f"sync-{protocol}", {}).get("total_s") if equal is not None else None,
            ),
        }
        timelines[name] = read_timelines(run_dir / "timelines.json")
    doc = {
        "commit": git_commit(),
        "config": {
            **{k: v for k, v in json.loads(cfg.to_json()).items() if k not in ("aggregation", "protocol", "rounds")},
            "sync_rounds": cfg.federation.rounds,
            "versions_factor": versions_factor,
            "link_rate": hosts.link_rate,
            "host_cpus": hosts.host_cpus or "auto",
            "target": target,
        },
        "runs": runs,
        "comparison": compare(runs),
    }
    (out / "async.json").write_text(json.dumps(doc, indent=1) + "\n")
    fed = cfg.federation
    title = f"{cfg.training.algorithm}, {cfg.data.dataset}, {fed.num_clients} clients, slowdown {fed.slowdown}"
    plot_accuracy({n: r["curve"] for n, r in runs.items()}, out / "accuracy.png", target, title)
    plot_timelines(timelines, out / "timelines.png", title)
    if show_progress:
        print(format_table(doc), file=sys.stderr)
    return 0 if ok else 1


def format_table(doc: Mapping[str, Any]) -> str:
    keys = (
        "versions",
        "total_s",
        "time_to_target_s",
        "final_gm_accuracy",
        "gm_at_equal_updates",
        "gm_at_sync_time",
        "idle_fraction",
        "staleness_mean",
    )
    lines = key_lines(doc["runs"], keys, _fmt, 20, 28)
    for p, c in doc["comparison"].items():
        lines.append(
            f"{p}: buffered reaches the target {_fmt(c['speedup_to_target'])}x sooner; accuracy - sync's final: "
            f"{_fmt(c['final_difference_equal_updates'])} at equal updates, {_fmt(c['final_difference_equal_time'])} "
            f"at equal wall-clock"
        )
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))

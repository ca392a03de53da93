"""``wafl bench protocols``: wait-free against compute-and-wait (and adaptive), same algorithm, seeds and config.

The protocols (``protocols``, default compute-and-wait and wait-free; ``--protocols
wait-free,compute-and-wait,adaptive`` adds adaptive) run as real federations (``wafl.cli.launch``:
a server and N client processes, optionally behind shaped links), one after the other,
compute-and-wait first, into ``OUT/<protocol>``. ``OUT/protocols.json`` then holds, per protocol:

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
compute-and-wait reaches within its time is not lost to wait-free's shorter run; adaptive, whose
rounds are no longer than compute-and-wait's, runs as many rounds as wait-free. The top level
holds ``speedup`` = compute-and-wait ``total_s`` per round / wait-free ``total_s`` per round,
``round_speedup`` (the same for the median ``round_s``), the ideal speedup
``(T_GM + T_PM + T_comm) / (T_GM + T_comm)`` from the compute-and-wait run's medians, and
``speedup_vs_ideal`` = speedup / ideal (``round_speedup_vs_ideal`` the same for the round
speedup), and with adaptive ``adaptive_zeta_vs_best`` = adaptive's ``zeta_total_s`` / the smaller of
the other two's (at most 1: adaptive reached the target no later than the better protocol). Each host
runs with its own CPU share (``host_cpus``; see :func:`bench_protocols`).
``OUT/timelines.png`` draws every client's phases under
both protocols (the paper's Fig. 2), ``OUT/pm_accuracy.png`` the PM accuracy against
wall-clock. The runs' model files (``checkpoint.pt``, ``clients/``) are deleted afterwards;
their records (``results.jsonl``, ``reports.jsonl``, ``timelines.json``, ``logs/``) stay.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wafl.cli.launch.hosts import Hosts
from wafl.cli.launch.measured import launch_measured, measured_hosts
from wafl.cli.report.bench_plots import PROTOCOL_ORDER, plot_pm_accuracy, plot_timelines
from wafl.cli.report.provenance import git_commit
from wafl.cli.report.run_records import read_jsonl, read_timelines, trained_phases
from wafl.cli.report.text_columns import key_lines
from wafl.cli.report.timeline_stats import (
    COMM_DEFINITION,
    IDEAL_DEFINITION,
    comm_durations,
    cpu_per_step,
    ideal_speedup,
    idle_fraction,
    median,
    phase_durations,
    pm_accuracy_curve,
    rounded,
    training_start,
    untracked_fraction,
    zeta_total,
)
from wafl.common.config import RunConfig
from wafl.common.contract import ClientProtocol

ZETA_TARGETS = (0.5, 0.6, 0.7, 0.8, 0.9)
DEFAULT_PROTOCOLS = ("compute-and-wait", "wait-free")


def bench_order(protocols: Sequence[str]) -> list[str]:
    """The protocols in the order they run: compute-and-wait first (its medians give the others' rounds), then
    the others in the order given, so that a series of repetitions can alternate them (a run's position, after
    one run or two on the same machine, is not then confounded with its protocol); ValueError names an unknown
    or repeated one."""
    unknown = [p for p in protocols if p not in PROTOCOL_ORDER]
    if unknown or len(set(protocols)) != len(protocols) or not protocols:
        raise ValueError(f"protocols={list(protocols)!r}: each of {list(PROTOCOL_ORDER)} at most once, at least one")
    return [p for p in protocols if p == "compute-and-wait"] + [p for p in protocols if p != "compute-and-wait"]


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
        "total_s": rounded(float(rows[-1]["wall_s"]) - t0) if rows else None,
        "rounds": len(rows),
        "round_s": rounded(median(float(r["round_s"]) for r in rows if r.get("round_s") is not None)),
        "idle_fraction": rounded(idle_fraction(timelines), 5),
        "idle_s": rounded(idle),
        "untracked_fraction": rounded(untracked_fraction(timelines), 5),
        "zeta_total_s": rounded(zeta_total(curve, target, t0)),
        "zeta_by_target_s": {f"{x:g}": rounded(zeta_total(curve, x, t0)) for x in sorted({*ZETA_TARGETS, target})},
        "first_round_s": rounded(float(rows[0]["round_s"])) if rows and rows[0].get("round_s") is not None else None,
        "later_round_s": rounded(median(float(r["round_s"]) for r in rows[1:] if r.get("round_s") is not None)),
        "t_gm_s": rounded(t_gm),
        "t_pm_s": rounded(t_pm),
        "t_upload_s": rounded(t_up),
        "t_comm_s": rounded(t_comm),
        "gm_cpu_per_step_s": rounded(gm_cpu_step, 5),
        "gm_cpu_per_wall_s": rounded(gm_cpu_wall),
        "final_gm_accuracy": rows[-1].get("gm_accuracy") if rows else None,
        "final_pm_accuracy": rounded(curve[-1][1]) if curve else None,
        "best_pm_accuracy": rounded(max(a for _, a in curve)) if curve else None,
        "start_s": rounded(t0),
        "clients": len(timelines),
        "out": str(out_dir),
    }


def equal_time_rounds(rounds: int, caw: Mapping[str, Any]) -> int:
    """The wait-free rounds that fit in compute-and-wait's time at the ideal speedup (``rounds``
    when the compute-and-wait run gave no phase medians)."""
    ideal = ideal_speedup(caw.get("t_gm_s"), caw.get("t_pm_s"), caw.get("t_comm_s"))
    return max(rounds, math.ceil(rounds * ideal)) if ideal else rounds


def adaptive_vs_best(zeta: Mapping[str, float | None]) -> float | None:
    """Adaptive's time to the PM target (``zeta``: protocol -> ``zeta_total_s``) over the better of
    compute-and-wait's and wait-free's; None when adaptive was not run or neither other protocol reached the
    target; ``inf`` when adaptive alone missed it."""
    others = [z for z in (zeta.get("compute-and-wait"), zeta.get("wait-free")) if z]
    if "adaptive" not in zeta or not others:
        return None
    mine = zeta["adaptive"]
    return mine / min(others) if mine else math.inf


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
    adaptive = results.get("adaptive")
    vs_best = adaptive_vs_best({p: r.get("zeta_total_s") for p, r in results.items()})
    vs_best = vs_best if vs_best is None or math.isfinite(vs_best) else None  # adaptive alone missed: no ratio
    round_speedup = None
    if caw.get("round_s") and wf.get("round_s"):
        round_speedup = caw["round_s"] / wf["round_s"]
    cpu_ratio = None
    if caw.get("gm_cpu_per_step_s") and wf.get("gm_cpu_per_step_s"):
        cpu_ratio = wf["gm_cpu_per_step_s"] / caw["gm_cpu_per_step_s"]
    return {
        "speedup": rounded(speedup),
        "round_speedup": rounded(round_speedup),
        "ideal_speedup": rounded(ideal),
        "speedup_vs_ideal": rounded(speedup / ideal) if speedup is not None and ideal else None,
        "round_speedup_vs_ideal": rounded(round_speedup / ideal) if round_speedup is not None and ideal else None,
        "zeta_speedup": rounded(zeta_speedup),
        **({"adaptive_zeta_vs_best": rounded(vs_best)} if adaptive is not None else {}),
        # the machine's speed during the two runs: > 1 when a GM step cost the wait-free run more CPU
        "gm_cpu_per_step_ratio": rounded(cpu_ratio),
        "ideal_definition": IDEAL_DEFINITION,
        "t_comm_definition": COMM_DEFINITION,
    }


def bench_protocols(
    cfg: RunConfig,
    out: Path,
    hosts: Hosts | None = None,
    target: float = 0.9,
    show_progress: bool = True,
    timeout_s: float = 3600.0,
    same_rounds: bool = False,
    protocols: Sequence[str] = DEFAULT_PROTOCOLS,
) -> int:
    """Runs ``cfg`` under each of ``protocols``; writes ``protocols.json`` and the two PNGs; 0 when every run
    finished.

    ``hosts``: the links and every host's CPU share (:func:`~wafl.cli.launch.measured.measured_hosts`, parsed
    from ``--link-rate`` and ``--host-cpus``); None: loopback, and ``auto`` shares (the cores split evenly
    between the server and the clients) where control groups can be used, else a warning and shared cores.
    Each protocol's entry records the shares, the quotas read back from the groups and the CPU each process
    used (``host_cpus``).
    """
    hosts = hosts or measured_hosts(cfg)
    link_rate = hosts.link_rate

    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    timelines: dict[str, Any] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    ok = True
    order = bench_order(protocols)
    rounds = {p: cfg.federation.rounds for p in order}
    for i, protocol in enumerate(order, 1):
        if protocol != "compute-and-wait" and not same_rounds:
            rounds[protocol] = equal_time_rounds(cfg.federation.rounds, results.get("compute-and-wait", {}))
        run_cfg = copy.deepcopy(cfg)
        run_cfg.client.protocol, run_cfg.federation.rounds = ClientProtocol(protocol), rounds[protocol]
        run_dir = out / protocol
        shutil.rmtree(run_dir / "clients", ignore_errors=True)  # no PM state of an earlier run
        if show_progress:
            print(
                f"[{i}/{len(order)}] {protocol}: {cfg.training.algorithm}, {cfg.data.dataset}, "
                f"{cfg.federation.num_clients} clients, {rounds[protocol]} rounds"
                + (f", links {link_rate}" if link_rate else ""),
                file=sys.stderr,
                flush=True,
            )
        summary, load = launch_measured(run_cfg, run_dir, hosts, show_progress, timeout_s)
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
            "algorithm": cfg.training.algorithm,
            "dataset": cfg.data.dataset,
            "num_clients": cfg.federation.num_clients,
            "rounds": cfg.federation.rounds,
            "rounds_per_protocol": rounds,
            "same_rounds": same_rounds,
            "local_epochs": cfg.training.local_epochs,
            "pm_epochs": cfg.client.pm_epochs,
            "pm_min_steps": cfg.client.pm_min_steps,
            "pm_max_epochs": cfg.client.pm_max_epochs,
            "pm_nice": cfg.client.pm_nice,
            "batch_size": cfg.training.batch_size,
            "partition": cfg.data.partition,
            "alpha": cfg.data.alpha,
            "seed": cfg.federation.seed,
            "params": cfg.training.params,
            "link_rate": link_rate,
            "host_cpus": hosts.host_cpus or "auto",
            "target": target,
        },
        "protocols": results,
        **compare(results),
    }
    (out / "protocols.json").write_text(json.dumps(doc, indent=2) + "\n")
    title = f"{cfg.training.algorithm}, {cfg.data.dataset}, {cfg.federation.num_clients} clients" + (
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
    lines = key_lines(doc["protocols"], keys, _fmt, 18, 18)
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
        "adaptive_zeta_vs_best",
        "gm_cpu_per_step_ratio",
    ):
        if k not in doc:
            continue
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

"""When wait-free pays: ``wafl bench protocols`` over a series of link rates, from communication-bound to
compute-bound, for SCD and Ditto, each host on a CPU share of its own (``--host-cpus auto``).

Under wait-free a client trains its PM from its upload until the next broadcast, so the last client
to upload (the largest shard) gets ``T_comm / (T_GM + T_comm)`` of the wall-clock for its PM;
under compute-and-wait every client gets ``T_PM / (T_GM + T_PM + T_comm)``. With ``x = T_comm /
T_GM`` and ``p = T_PM / T_GM`` the wait-free share is the larger one where ``x (1 + x) > p``: the
predicted crossover is ``x* = (sqrt(1 + 4 p) - 1) / 2``. For every point (algorithm, link rate,
repetition) this records, from the bench's ``protocols.json``: ``x`` and ``p`` (medians of the
compute-and-wait run), the round speedup against the ideal, the time to the PM target under both
protocols and their ratio (wait-free over compute-and-wait: below 1, wait-free reaches it sooner),
and each client's PM share of its wall-clock under both; then ``crossover.json`` and one figure,
``crossover.png``: the time-to-target ratio against ``x``, with the predicted crossover drawn
beside the measured points.

    python benchmarks/waitfree_crossover.py                     # 2 algorithms x 4 rates x 2 repetitions
    python benchmarks/waitfree_crossover.py --rates 2mbit,5mbit,10mbit,20mbit,100mbit --reps 3
    python benchmarks/waitfree_crossover.py --heterogeneous     # and the two heterogeneous points

With adaptive among ``--protocols`` (the default runs all three), each point also records adaptive's time
to the target over the better of the other two (``adaptive_vs_best``; at most 1.05 is the target) and the
figure draws adaptive's ratio to compute-and-wait beside wait-free's. ``--heterogeneous`` adds, per algorithm
and repetition, the points of :func:`heterogeneous`, where the clients differ (one link rate each, or one
compute slow-down each): there one protocol for all is wrong for some clients, and a per-client decision
should beat both.

Where adaptive keeps wait-free's schedule in every round (above the crossover), its time to the target and
wait-free's are two draws of one schedule: a run's time is the round in which the mean PM accuracy first
crosses the target, and one round more or less moves it by 30-80 % at the fast points. So the summary also
gives, per algorithm and rate, each protocol's mean time over the repetitions and adaptive's mean over the
better mean (``by_rate``; ``adaptive_mean_within_target`` counts the rates within 1.05). Compute-and-wait runs
first in every repetition (its medians set the others' rounds); wait-free and adaptive swap places from one
repetition to the next (:func:`rep_order`; each point records its ``order``).

A point whose ``protocols.json`` exists with every protocol asked for is not run again (``--out`` keeps
them), so a stopped series resumes. It needs root (network namespaces, ``tc``, control groups) and a
machine whose cores do nothing else while it runs: each point's figures are wall-clock times.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from wafl.cli.experiments.bench import adaptive_vs_best

RESULTS = Path(__file__).resolve().parent / "results" / "protocols" / "crossover"
WAFL = str(Path(sys.executable).parent / "wafl")
PROTOCOLS = ("compute-and-wait", "wait-free")  # the two whose ratio places a point against the crossover
ALL_PROTOCOLS = (*PROTOCOLS, "adaptive")
ADAPTIVE_TARGET = 1.05  # adaptive's time to the PM target at most this times the better protocol's


def heterogeneous(clients: int) -> dict[str, tuple[str, tuple[str, ...]]]:
    """The heterogeneous points: name -> (the bench's ``--link-rate``, its ``--set`` settings). Client ``i``
    gets the ``i % 4``-th of: link rates from both sides of the crossover (2, 5, 20 and 100 Mbit/s), or,
    at 20 Mbit/s, its training slowed by 1, 1, 2 and 4 (``slowdown``)."""
    rates = ",".join(("2mbit", "5mbit", "20mbit", "100mbit")[i % 4] for i in range(clients))
    slow = ",".join(("1", "1", "2", "4")[i % 4] for i in range(clients))
    return {"hetero-links": (rates, ()), "hetero-slowdown": ("20mbit", (f"slowdown={slow}",))}


def predicted_crossover(p: float) -> float:
    """The ``x = T_comm / T_GM`` above which wait-free gives the last client the larger PM share."""
    return (math.sqrt(1.0 + 4.0 * p) - 1.0) / 2.0


def share_ratio(x: float, p: float) -> float:
    """The model's wait-free PM share of the last client over its compute-and-wait share."""
    return (x / (1.0 + x)) / (p / (1.0 + p + x))


def pm_shares(timelines: dict[str, Any]) -> dict[str, float]:
    """Each client's PM training seconds over its wall-clock from its first GM phase to its last event."""
    out = {}
    for client, t in sorted(timelines.items()):
        events = t.get("events", [])
        gm = [e["start_s"] for e in events if e["phase"] == "gm_train"]
        if not gm:
            continue
        span = max(e["end_s"] for e in events) - min(gm)
        pm = sum(e["end_s"] - e["start_s"] for e in events if e["phase"] == "pm_train")
        out[client] = round(pm / span, 4) if span > 0 else 0.0
    return out


def pre_upload_share(timelines: dict[str, Any]) -> float | None:
    """The share of an adaptive run's decisions (one a client and round, its ``decide`` mark) after which the
    client trained PM steps before its upload; 0 is wait-free's schedule in every round, None no decision."""
    decided = pre = 0
    for t in timelines.values():
        events = t.get("events", [])
        for mark in (e for e in events if e["phase"] == "decide"):
            decided += 1
            at = mark["start_s"]
            upload = min((e["start_s"] for e in events if e["phase"] == "upload" and e["start_s"] >= at), default=None)
            # a pre-upload PM ends before the upload starts (the background one starts with it and outlasts it)
            if upload is not None and any(
                e["phase"] == "pm_train" and at <= e["start_s"] and e["end_s"] <= upload for e in events
            ):
                pre += 1
    return round(pre / decided, 4) if decided else None


def point(folder: Path) -> dict[str, Any]:
    """What one bench run (``folder/protocols.json``) says about the crossover."""
    doc = json.loads((folder / "protocols.json").read_text())
    runs = doc["protocols"]
    cw, wf = (runs[p] for p in PROTOCOLS)
    x = cw["t_comm_s"] / cw["t_gm_s"] if cw.get("t_gm_s") else None
    p = cw["t_pm_s"] / cw["t_gm_s"] if cw.get("t_gm_s") and cw.get("t_pm_s") is not None else None
    ran = [proto for proto in ALL_PROTOCOLS if proto in runs]
    zeta = {proto: runs[proto].get("zeta_total_s") for proto in ran}
    shares = {}
    for proto in ran:
        tl = folder / proto / "timelines.json"
        shares[proto] = pm_shares(json.loads(tl.read_text())) if tl.is_file() else {}
    out = {
        "commit": doc["commit"],
        "ok": all(runs[proto].get("ok") for proto in ran),
        "t_gm_s": cw.get("t_gm_s"),
        "t_pm_s": cw.get("t_pm_s"),
        "t_comm_s": cw.get("t_comm_s"),
        "x": round(x, 4) if x is not None else None,
        "p": round(p, 4) if p is not None else None,
        "round_speedup": doc.get("round_speedup"),
        "ideal_speedup": doc.get("ideal_speedup"),
        "speedup_vs_ideal": doc.get("speedup_vs_ideal"),
        "order": list(runs),  # the order the protocols ran in (protocols.json keeps it)
        "zeta_s": zeta,
        "zeta_ratio": round(zeta["wait-free"] / zeta["compute-and-wait"], 4)
        if zeta["wait-free"] and zeta["compute-and-wait"]
        else None,
        "pm_share": shares,
        "final_pm_accuracy": {proto: runs[proto].get("final_pm_accuracy") for proto in ran},
        # the machine's speed in each run: CPU seconds per GM step (the same work in every run of a point)
        "gm_cpu_per_step_s": {proto: runs[proto].get("gm_cpu_per_step_s") for proto in ran},
    }
    if "adaptive" in runs:
        tl = folder / "adaptive" / "timelines.json"
        out["adaptive_pre_upload"] = pre_upload_share(json.loads(tl.read_text())) if tl.is_file() else None
        ratio = adaptive_vs_best(zeta)
        out["adaptive_vs_best"] = round(ratio, 4) if ratio is not None and math.isfinite(ratio) else ratio
        out["adaptive_vs_cw"] = (
            round(zeta["adaptive"] / zeta["compute-and-wait"], 4)
            if zeta["adaptive"] and zeta["compute-and-wait"]
            else None
        )
    return out


def rep_order(protocols: tuple[str, ...], rep: int) -> tuple[str, ...]:
    """The order repetition ``rep`` runs ``protocols`` in: compute-and-wait first (the bench's rule), then the
    others as given in odd repetitions and reversed in even ones, so that over a series each of wait-free and
    adaptive runs as often right after compute-and-wait as last (a machine's speed drifts between runs)."""
    rest = [p for p in protocols if p != "compute-and-wait"]
    return ("compute-and-wait", *(rest if rep % 2 else rest[::-1]))


def has_run(folder: Path, protocols: tuple[str, ...]) -> bool:
    """Whether ``folder`` holds a finished bench of every one of ``protocols``."""
    path = folder / "protocols.json"
    return path.is_file() and set(protocols) <= set(json.loads(path.read_text())["protocols"])


def run_point(
    folder: Path, algorithm: str, rate: str, clients: int, target: float, extra: list[str], protocols: tuple[str, ...]
) -> int:
    if has_run(folder, protocols):
        return 0
    cmd = [WAFL, "bench", "protocols", "--algorithm", algorithm, "--clients", str(clients), "--link-rate", rate]
    cmd += ["--protocols", ",".join(protocols), "--target", str(target), "--out", str(folder), "--quiet", *extra]
    print(f"== {algorithm} {rate} {' '.join(extra)} -> {folder}", file=sys.stderr, flush=True)
    return subprocess.call(cmd)


def wait_free_missed(points: list[dict[str, Any]], algorithm: str) -> list[dict[str, Any]]:
    """The points where compute-and-wait reached the PM target within the run's rounds and wait-free did not."""
    return [
        pt
        for pt in points
        if pt["algorithm"] == algorithm
        and pt["x"]
        and pt["zeta_s"]["compute-and-wait"] is not None
        and pt["zeta_s"]["wait-free"] is None
    ]


def by_rate(points: list[dict[str, Any]], algorithm: str) -> list[dict[str, Any]]:
    """Per rate (in the points' order) over its repetitions: each protocol's mean time to the PM target (None
    where it missed the target in any repetition, which no mean of the others can stand for), adaptive's
    mean over the better of the other two means (``adaptive_vs_best`` of the means), and the runs' own
    ratios beside it; ``gm_cpu_per_step_spread`` is the slowest over the fastest CPU seconds per GM step among
    the rate's runs, the machine's own run-to-run spread in the same work."""
    out = []
    for rate in dict.fromkeys(pt["rate"] for pt in points if pt["algorithm"] == algorithm):
        mine = [pt for pt in points if (pt["algorithm"], pt["rate"]) == (algorithm, rate)]
        protocols = [p for p in ALL_PROTOCOLS if all(p in pt["zeta_s"] for pt in mine)]
        zetas = {p: [pt["zeta_s"][p] for pt in mine] for p in protocols}
        mean = {p: round(statistics.fmean(z), 4) if all(z) else None for p, z in zetas.items()}
        cpu = [c for pt in mine for c in pt.get("gm_cpu_per_step_s", {}).values() if c]
        row: dict[str, Any] = {"rate": rate, "reps": len(mine), "zeta_mean_s": mean}
        # how far the machine's speed moved between the runs of the rate: the slowest GM step over the fastest
        row["gm_cpu_per_step_spread"] = round(max(cpu) / min(cpu), 4) if cpu else None
        if "adaptive" in protocols:
            ratio = adaptive_vs_best(mean)
            row["adaptive_vs_best"] = round(ratio, 4) if ratio is not None and math.isfinite(ratio) else ratio
            row["adaptive_vs_best_runs"] = [pt.get("adaptive_vs_best") for pt in mine]
        out.append(row)
    return out


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per algorithm: the median ``p`` of its points, the predicted crossover and the measured points, and
    with adaptive the counts per run and per rate (:func:`by_rate`)."""
    out: dict[str, Any] = {}
    for alg in sorted({pt["algorithm"] for pt in points}):
        mine = [pt for pt in points if pt["algorithm"] == alg]
        ps = [pt["p"] for pt in mine if pt["p"] is not None]
        p = statistics.median(ps) if ps else None
        out[alg] = {
            "p_median": round(p, 4) if p is not None else None,
            "predicted_crossover_x": round(predicted_crossover(p), 4) if p is not None else None,
            "points": len(mine),
            "wait_free_sooner": sum(1 for pt in mine if pt["zeta_ratio"] is not None and pt["zeta_ratio"] < 1),
            "no_time_to_target": sum(1 for pt in mine if pt["zeta_ratio"] is None),
            "wait_free_missed_target": len(wait_free_missed(points, alg)),
        }
        adaptive = [pt for pt in mine if "adaptive_vs_best" in pt]
        if adaptive:
            ratios = [pt["adaptive_vs_best"] for pt in adaptive if pt["adaptive_vs_best"] is not None]
            out[alg].update(
                adaptive_points=len(adaptive),
                adaptive_within_target=sum(1 for r in ratios if r <= ADAPTIVE_TARGET),
                adaptive_below_both=sum(1 for r in ratios if r < 1),
                adaptive_worst_vs_best=max(ratios) if ratios else None,
                # where adaptive kept wait-free's schedule in every round, its ratio to wait-free is run-to-run noise
                adaptive_all_wait_free=sum(1 for pt in adaptive if pt.get("adaptive_pre_upload") == 0),
            )
            rows = by_rate(mine, alg)
            means = [r["adaptive_vs_best"] for r in rows if r.get("adaptive_vs_best") is not None]
            out[alg].update(
                by_rate=rows,
                adaptive_mean_within_target=sum(1 for r in means if r <= ADAPTIVE_TARGET),
                adaptive_mean_worst_vs_best=max(means) if means else None,
            )
    return out


def plot(points: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algs = sorted(summary)
    fig, axes = plt.subplots(1, len(algs), figsize=(5.5 * len(algs), 4.2), squeeze=False)
    for ax, alg in zip(axes[0], algs):
        mine = [pt for pt in points if pt["algorithm"] == alg and pt["x"] and pt["zeta_ratio"] is not None]
        for rate in dict.fromkeys(pt["rate"] for pt in mine):  # in the order of --rates
            xs = [pt["x"] for pt in mine if pt["rate"] == rate]
            ys = [pt["zeta_ratio"] for pt in mine if pt["rate"] == rate]
            ax.scatter(xs, ys, label=rate, zorder=3)
        ad = [pt for pt in points if pt["algorithm"] == alg and pt["x"] and pt.get("adaptive_vs_cw") is not None]
        if ad:  # hollow: adaptive over compute-and-wait at the same points
            ax.scatter([pt["x"] for pt in ad], [pt["adaptive_vs_cw"] for pt in ad], facecolors="none",
                       edgecolors="k", marker="D", zorder=4, label="adaptive / C&W")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8)
        missed = wait_free_missed(points, alg)  # drawn above the measured ratios
        if missed:
            top = 1.25 * max([pt["zeta_ratio"] for pt in mine] + [1.0])
            ax.scatter([pt["x"] for pt in missed], [top] * len(missed), marker="^", color="k", zorder=3,
                       label="wait-free did not reach the target")  # fmt: skip
        s = summary[alg]
        if s["predicted_crossover_x"] is not None:
            ax.axvline(
                s["predicted_crossover_x"],
                color="C3",
                ls="--",
                label=f"predicted x* = {s['predicted_crossover_x']:.2f}",
            )
            xs_all = [pt["x"] for pt in points if pt["algorithm"] == alg and pt["x"]]
            if xs_all:
                lo, hi = min(xs_all) / 2, max(xs_all) * 2
                grid = [lo * (hi / lo) ** (i / 60) for i in range(61)]
                ax.plot(grid, [1 / share_ratio(g, s["p_median"]) for g in grid], color="C3", lw=0.8,
                        label="model: C&W / WF PM share")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("T_comm / T_GM (compute-and-wait medians)")
        ax.set_ylabel("time to PM target / compute-and-wait's")
        measured = [pt["zeta_ratio"] for pt in mine] + [pt["adaptive_vs_cw"] for pt in ad] + [1.0]
        ax.set_ylim(0, 1.5 * max(measured))  # the model's curve rises without bound below x*
        ax.set_title(f"{alg}: below 1, sooner than compute-and-wait")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from _machine import provenance  # run as a script: benchmarks/ is on the path (its functions import without it)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="benchmarks/waitfree_crossover.py")
    ap.add_argument("--algorithms", default="scd,ditto")
    ap.add_argument("--rates", default="2mbit,5mbit,20mbit,100mbit", help="per-client link rates (tc syntax)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every point")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--target", type=float, default=0.9, help="PM accuracy for the time to target")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="passed to the bench")
    ap.add_argument("--protocols", default=",".join(ALL_PROTOCOLS), help="the bench's (C&W and WF at least)")
    ap.add_argument("--heterogeneous", action="store_true", help="add the two heterogeneous points")
    ap.add_argument("--heterogeneous-reps", type=int, default=1, help="repetitions of the heterogeneous points")
    ap.add_argument("--heterogeneous-algorithms", help="the algorithms of the heterogeneous points (default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--smoke", action="store_true", help="ditto, 2 clients, 2 rates, 1 repetition, 2 rounds")
    a = ap.parse_args(argv)
    extra = [x for s in a.set for x in ("--set", s)]
    if a.smoke:
        a.algorithms, a.rates, a.reps, a.target, a.clients = "ditto", "50mbit,200mbit", 1, 0.3, 2
        extra += ["--rounds", "2"]
    if a.reps < 1 or a.heterogeneous_reps < 1:
        ap.error("--reps and --heterogeneous-reps must be at least 1")
    protocols = tuple(x.strip() for x in a.protocols.split(",") if x.strip())
    if set(protocols) - set(ALL_PROTOCOLS) or not set(PROTOCOLS) <= set(protocols):
        ap.error(f"--protocols {a.protocols!r}: {', '.join(PROTOCOLS)} and optionally adaptive")
    rates = [r.strip() for r in a.rates.split(",") if r.strip()]
    algs = [x.strip() for x in a.algorithms.split(",") if x.strip()]
    # (label, --link-rate, settings): the series' rates, then the heterogeneous points
    series = [(rep, rate, rate, ()) for rep in range(1, a.reps + 1) for rate in rates]
    if a.heterogeneous:  # after the whole series, so that a stopped run leaves the series complete
        hetero = heterogeneous(a.clients).items()
        series += [(rep, n, rate, sets) for rep in range(1, a.heterogeneous_reps + 1) for n, (rate, sets) in hetero]
    hetero_algs = [x.strip() for x in (a.heterogeneous_algorithms or a.algorithms).split(",") if x.strip()]
    points: list[dict[str, Any]] = []
    failed = []
    for rep, label, rate, sets in series:
        for alg in algs if label in rates else [x for x in algs if x in hetero_algs]:
            folder = a.out / alg / label / f"rep{rep}"
            more = extra + [x for s in sets for x in ("--set", s)]
            if run_point(folder, alg, rate, a.clients, a.target, more, rep_order(protocols, rep)) != 0 or not has_run(
                folder, protocols
            ):
                failed.append(str(folder))
                continue
            points.append({"algorithm": alg, "rate": label, "rep": rep, **point(folder)})
    summary = summarize(points)
    a.out.mkdir(parents=True, exist_ok=True)
    if points:
        plot(points, summary, a.out / "crossover.png")
    doc = {
        "benchmark": "waitfree_crossover",
        **provenance(),
        "smoke": a.smoke,
        "rates": rates,
        "protocols": list(protocols),
        "heterogeneous": {n: {"link_rate": r, "settings": list(st)} for n, (r, st) in heterogeneous(a.clients).items()}
        if a.heterogeneous
        else {},
        "adaptive_target": ADAPTIVE_TARGET,
        "reps": a.reps,
        "heterogeneous_reps": a.heterogeneous_reps if a.heterogeneous else 0,
        "heterogeneous_algorithms": hetero_algs if a.heterogeneous else [],
        "clients": a.clients,
        "target": a.target,
        "settings": a.set + (["rounds=2"] if a.smoke else []),
        "model": "wait-free PM share T_comm/(T_GM+T_comm) against compute-and-wait T_PM/(T_GM+T_PM+T_comm): "
        "x* = (sqrt(1+4p)-1)/2 with x = T_comm/T_GM, p = T_PM/T_GM",
        "summary": summary,
        "points": points,
        "failed": failed,
        "figure_bytes": (a.out / "crossover.png").stat().st_size if points else 0,
    }
    (a.out / "crossover.json").write_text(json.dumps(doc, indent=1) + "\n")
    for alg, s in summary.items():
        print(f"{alg}: p {s['p_median']}, predicted crossover x* {s['predicted_crossover_x']}, "
              f"wait-free sooner in {s['wait_free_sooner']} of {s['points']} points", flush=True)  # fmt: skip
    for pt in points:
        ad = f", adaptive / best {pt['adaptive_vs_best']}" if "adaptive_vs_best" in pt else ""
        print(f"  {pt['algorithm']} {pt['rate']} rep{pt['rep']}: x {pt['x']}, zeta WF/C&W {pt['zeta_ratio']}{ad}, "
              f"round speedup {pt['round_speedup']} (ideal {pt['ideal_speedup']})", flush=True)  # fmt: skip
    for alg, s in summary.items():
        for r in s.get("by_rate", []):
            print(f"  {alg} {r['rate']} over {r['reps']} reps: mean zeta {r['zeta_mean_s']}, adaptive / best "
                  f"{r['adaptive_vs_best']} (runs {r['adaptive_vs_best_runs']}), GM CPU a step spread "
                  f"{r['gm_cpu_per_step_spread']}", flush=True)  # fmt: skip
    print(f"wrote {a.out / 'crossover.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Learning check for spectral co-distillation (SCD) on the bundled digits.

Run from the repository root (one thread; use ``nice -n 19`` on a shared machine)::

    python benchmarks/scd_digits.py          # writes benchmarks/results/scd_digits.{json,md}

Digits, 10 clients, per-class Dirichlet(0.1) split, every client every round, compute-and-wait
(GM ``local_epochs`` then PM ``pm_epochs`` per round), seeds 0 1 2: FedAvg, Ditto, SCD and the
SCD ablations ``lambda_p = 0`` (no SCD-PM: the PM trains with plain CE) and ``lambda_g = 0``
(no SCD-GM: the GM is FedAvg's). Final GM accuracy (global test split) and PM accuracy
(local test sets, weighted by their size), mean/std/min/max over the seeds.

Target (from the issue): SCD's PM accuracy at least Ditto's and above FedAvg's GM accuracy.

Budget. SCD's spectrum is a full-length FFT of the 154,474-entry weight vector at every step
(154,474 = 2 x 77,237, a large prime factor: the FFT takes about twice as long as for the
smooth length 154,476), several times the cost of a CE step on this CNN. Every method
therefore gets the same small budget: batch 64, one GM epoch and one PM epoch per round,
``--rounds`` rounds (default 15).

Sweep. ALGORITHMS.md gives SGD lr 0.03 momentum 0.5 and ``lambda_g = 0.3``, ``lambda_p = 0.4``
as a starting point to tune on the bundled data. Before the main runs a small sweep on a
held-out seed (``--sweep-seed``, not one of the evaluation seeds) and ``--sweep-rounds`` rounds
picks (1) one optimizer shared by all methods, by FedAvg's GM + Ditto's PM accuracy, then
(2) Ditto's ``mu`` and SCD's ``(lambda_g, lambda_p)`` by PM accuracy. Every sweep run is
recorded in the JSON. ``--no-sweep`` skips it and uses the fixed fallbacks below.
"""

from __future__ import annotations

import argparse
from typing import Any

import _learning as L

NAME = "scd_digits"
BASE: dict[str, Any] = {
    "dataset": "digits",
    "num_clients": 10,
    "partition": "dirichlet",
    "alpha": 0.1,
    "fraction": 1.0,
    "batch_size": 64,
    "local_epochs": 1,  # E_G
    "pm_epochs": 1,  # E_P
    "protocol": "compute-and-wait",
    "device": "cpu",
    "checkpoint": False,
}
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd lr 0.03 m 0.5": {"optimizer": "sgd", "lr": 0.03, "momentum": 0.5},  # ALGORITHMS.md's SCD default
    "sgd lr 0.05 m 0.9": {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9},  # RunConfig's default
    "adam lr 0.003": {"optimizer": "adam", "lr": 0.003, "momentum": 0.0},
}
DITTO_MU = (0.01, 0.1, 1.0)
SCD_LAMBDAS = ((0.3, 0.4), (0.3, 2.0), (1.0, 0.4))  # (lambda_g, lambda_p); the first is the default
SCD_FIXED = {"tau": 0.4, "spectrum": "model"}
FALLBACK = {"optimizer": "adam lr 0.003", "mu": 0.1, "lambdas": (0.3, 0.4)}
# Extra rows, run after the main comparison and not chosen by the sweep: with lambda_p = 0.4 the
# gradient of lambda_p * D(s(w_p) || s(w_G)) on this CNN is ~0.008 against a CE gradient of 1-3
# (D itself is ~0.007), so the PM trains almost as with lambda_p = 0. These scale the weights so
# that the spectral gradient is of the order of a tenth to a third of CE's.
EXTRA = {"scd lambda_p=40": {"lambda_p": 40.0}, "scd lambda_g=30 lambda_p=40": {"lambda_g": 30.0, "lambda_p": 40.0}}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep-seed", type=int, default=100, help="seed of the tuning sweep (kept apart from --seeds)")
    p.add_argument("--sweep-rounds", type=int, default=5, help="rounds of each sweep run")
    p.add_argument("--no-sweep", action="store_true", help="skip the sweep; use the fallback settings")
    p.add_argument("--no-extra", action="store_true", help="skip the extra rows with large spectral weights")


def sweep(args: argparse.Namespace, reuse: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    seeds = [args.sweep_seed]
    cfg = lambda **kw: L.make_config(BASE, rounds=args.sweep_rounds, **kw)
    L.log(f"sweep, stage 1: optimizer (seed {args.sweep_seed}, {args.sweep_rounds} rounds)")
    stage1 = {}
    for name, opt in OPTIMIZERS.items():
        stage1[f"fedavg / {name}"] = cfg(algorithm="fedavg", **opt)
        stage1[f"ditto mu 0.1 / {name}"] = cfg(algorithm="ditto", params={"mu": 0.1}, **opt)
    r1 = L.run_suite(stage1, seeds, tag="sweep ", reuse=reuse)
    score = {
        n: r1[f"fedavg / {n}"]["gm_accuracy"]["mean"] + r1[f"ditto mu 0.1 / {n}"]["pm_accuracy"]["mean"]
        for n in OPTIMIZERS
    }
    opt_name = max(OPTIMIZERS, key=lambda n: (score[n], -list(OPTIMIZERS).index(n)))
    opt = OPTIMIZERS[opt_name]
    L.log(f"sweep: optimizer {opt_name} (FedAvg GM + Ditto PM = {score[opt_name]:.3f})")

    L.log("sweep, stage 2: Ditto mu and SCD (lambda_g, lambda_p)")
    stage2 = {
        f"ditto mu {mu} / {opt_name}": cfg(algorithm="ditto", params={"mu": mu}, **opt) for mu in DITTO_MU if mu != 0.1
    }
    for lg, lp in SCD_LAMBDAS:
        stage2[f"scd lambda_g {lg} lambda_p {lp} / {opt_name}"] = cfg(
            algorithm="scd", params={**SCD_FIXED, "lambda_g": lg, "lambda_p": lp}, **opt
        )
    r2 = L.run_suite(stage2, seeds, tag="sweep ", reuse=reuse)
    runs = {**r1, **r2}
    ditto_names = {mu: f"ditto mu {mu} / {opt_name}" for mu in DITTO_MU}
    mu = max(DITTO_MU, key=lambda m: (runs[ditto_names[m]]["pm_accuracy"]["mean"], -DITTO_MU.index(m)))
    scd_names = {lam: f"scd lambda_g {lam[0]} lambda_p {lam[1]} / {opt_name}" for lam in SCD_LAMBDAS}
    lambdas = max(SCD_LAMBDAS, key=lambda lam: (runs[scd_names[lam]]["pm_accuracy"]["mean"], -SCD_LAMBDAS.index(lam)))
    chosen = {"optimizer": opt_name, "mu": mu, "lambdas": lambdas}
    L.log(f"sweep: chose {chosen}")
    record = {
        "seed": args.sweep_seed,
        "rounds": args.sweep_rounds,
        "rule": (
            "optimizer: max FedAvg GM + Ditto(mu 0.1) PM; then Ditto mu and SCD (lambda_g, lambda_p): max "
            "PM; final-round accuracy, ties to the earlier (default) entry"
        ),
        "optimizer_scores": score,
        "chosen": chosen,
        "runs": runs,
    }
    return chosen, record


def sweep_table(record: dict[str, Any]) -> str:
    rows = []
    for name, r in record["runs"].items():
        rows.append(
            [
                name,
                L.pct(r.get("gm_accuracy"), spread=False).split(" ±")[0],
                L.pct(r.get("pm_accuracy"), spread=False).split(" ±")[0],
            ]
        )
    return L.markdown_table([f"Sweep run (seed {record['seed']}, {record['rounds']} rounds)", "GM (%)", "PM (%)"], rows)


def main() -> None:
    args = L.parse_args(NAME, __doc__.split("\n")[0], default_rounds=15, add=options)
    rep = L.Report(NAME, args, __doc__)
    if args.no_sweep:
        chosen, record = dict(FALLBACK), None
    else:
        chosen, record = sweep(args, rep.reuse)
    rep["sweep"] = record
    opt = OPTIMIZERS[chosen["optimizer"]]
    lg, lp = chosen["lambdas"]
    scd = {**SCD_FIXED, "lambda_g": lg, "lambda_p": lp}
    cfg = lambda **kw: L.make_config(BASE, rounds=args.rounds, **opt, **kw)
    configs = {
        "fedavg": cfg(algorithm="fedavg"),
        "ditto": cfg(algorithm="ditto", params={"mu": chosen["mu"]}),
        "scd": cfg(algorithm="scd", params=scd),
        "scd lambda_p=0": cfg(algorithm="scd", params={**scd, "lambda_p": 0.0}),
        "scd lambda_g=0": cfg(algorithm="scd", params={**scd, "lambda_g": 0.0}),
    }
    if not args.no_extra:
        configs.update({name: cfg(algorithm="scd", params={**scd, **over}) for name, over in EXTRA.items()})
    rep["settings"] = {
        "base": {**BASE, **opt, "rounds": args.rounds},
        "chosen": chosen,
        "note": "same rounds, batch, epochs and optimizer for every method; PM = compute-and-wait, pm_epochs per round",
    }
    L.log(f"main runs: {len(configs)} configurations x seeds {args.seeds}, {args.rounds} rounds, {chosen}")
    res = L.run_suite(configs, args.seeds, reuse=rep.reuse)
    rep["results"] = res

    scd_pm = res["scd"]["pm_accuracy"]["mean"]
    ditto_pm = res["ditto"]["pm_accuracy"]["mean"]
    fedavg_gm = res["fedavg"]["gm_accuracy"]["mean"]
    target = {
        "scd_pm_mean": scd_pm,
        "ditto_pm_mean": ditto_pm,
        "fedavg_gm_mean": fedavg_gm,
        "scd_pm_at_least_ditto_pm": scd_pm >= ditto_pm,
        "scd_pm_above_fedavg_gm": scd_pm > fedavg_gm,
    }
    target["met"] = target["scd_pm_at_least_ditto_pm"] and target["scd_pm_above_fedavg_gm"]
    ditto_by_seed = {r["seed"]: r["pm_accuracy"] for r in res["ditto"]["runs"]}
    target["scd_pm_minus_ditto_pm_per_seed"] = {
        n: [r["pm_accuracy"] - ditto_by_seed[r["seed"]] for r in res[n]["runs"]] for n in res if n.startswith("scd")
    }
    target["extra_rows_meeting_it"] = [
        n
        for n in EXTRA
        if n in res and res[n]["pm_accuracy"]["mean"] >= ditto_pm and res[n]["pm_accuracy"]["mean"] > fedavg_gm
    ]
    rep["target"] = target

    wall = lambda r: f"{r['wall_s'] / len(r['runs']):.0f}"
    rows = [
        ("FedAvg", "fedavg"),
        (f"Ditto (mu = {chosen['mu']})", "ditto"),
        (f"SCD (lambda_g = {lg}, lambda_p = {lp})", "scd"),
        ("SCD, lambda_p = 0 (no SCD-PM)", "scd lambda_p=0"),
        ("SCD, lambda_g = 0 (no SCD-GM)", "scd lambda_g=0"),
    ]
    for name, over in EXTRA.items():
        if name in res:
            p = {**scd, **over}
            rows.append(
                (f"SCD, lambda_g = {p['lambda_g']:g}, lambda_p = {p['lambda_p']:g} (extra, not from the sweep)", name)
            )

    def vs_ditto(r: dict[str, Any]) -> str:
        d = [x["pm_accuracy"] - ditto_by_seed[x["seed"]] for x in r["runs"] if x["pm_accuracy"] is not None]
        if not d or r is res["ditto"]:
            return "—"
        return f"{100 * sum(d) / len(d):+.1f} ({100 * min(d):+.1f} to {100 * max(d):+.1f})"

    table = L.accuracy_table(res, rows, extra={"PM − Ditto PM, same seed": vs_ditto, "s / run": wall})
    verdict = (
        f"Target (SCD PM >= Ditto PM and > FedAvg GM): {'met' if target['met'] else 'not met'} "
        f"(SCD PM {100 * scd_pm:.1f}, Ditto PM {100 * ditto_pm:.1f}, FedAvg GM {100 * fedavg_gm:.1f})."
    )
    settings = (
        f"Digits, 10 clients, Dirichlet alpha = 0.1, all clients every round, {args.rounds} rounds, seeds "
        f"{', '.join(map(str, args.seeds))}; batch {BASE['batch_size']}, E_G = {BASE['local_epochs']}, "
        f"E_P = {BASE['pm_epochs']} (compute-and-wait), {chosen['optimizer']} for every method; SCD tau = "
        f"{SCD_FIXED['tau']}, spectrum = {SCD_FIXED['spectrum']}. Final-round accuracy in %: mean ± std over seeds "
        "(min–max). GM: global test split; PM: local test sets weighted by size. s / run: wall time per run "
        "at nice 19 on a 2-core machine shared with other jobs, so it varies with their load (the extra rows "
        "ran later, under lighter load)."
    )
    if any(n in res for n in EXTRA):
        verdict += (
            " Extra rows: with lambda_p = 0.4 the spectral term's gradient on this CNN is ~0.008 against a CE gradient "
            "of 1-3, so the PM trains almost as with lambda_p = 0; the extra rows raise lambda_p to 40 (and "
            f"lambda_g to 30) (meeting the target: {', '.join(target['extra_rows_meeting_it']) or 'none'})."
        )
    md = f"{table}\n\n{settings}\n\n{verdict}\n"
    if record is not None:
        md += (
            f"\nSettings chosen by a sweep on seed {record['seed']} ({record['rounds']} rounds), {record['rule']}:"
            f"\n\n{sweep_table(record)}\n"
        )
    rep.write(md)


if __name__ == "__main__":
    main()

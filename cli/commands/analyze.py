"""``wafl analyze flatness`` and ``wafl analyze curves``: their flags, checked, then the measurement
(:mod:`wafl.cli.report.analyze`) or the figure (:mod:`wafl.cli.report.curves`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from wafl.cli.commands.process import set_threads
from wafl.cli.report import analyze, curves
from wafl.cli.report.provenance import git_commit
from wafl.cli.report.table import DEFAULT_BY, TableError, find_runs
from wafl.common.errors import UsageError


def cmd_flatness(a: argparse.Namespace) -> int:
    folders = analyze.run_folders([Path(p) for p in a.dirs])
    if a.density and len(folders) > 1:
        raise UsageError(f"--density draws one run's density; {len(folders)} run folders were given")
    if a.checkpoint and len(folders) > 1:
        raise UsageError(f"--checkpoint names one run's checkpoint; {len(folders)} run folders were given")
    if a.checkpoint and a.round:
        raise UsageError("--checkpoint and --round both name a checkpoint: give one")
    if a.threads:
        set_threads(a.threads)
    results = []
    for f in folders:
        chosen = Path(a.checkpoint) if a.checkpoint else None
        if a.round:
            chosen = f / "checkpoints" / f"round-{a.round}.pt"
        r = analyze.flatness(
            f,
            checkpoint=chosen,
            samples=a.samples,
            sample_seed=a.sample_seed,
            probes=a.probes,
            max_iter=a.max_iter,
            tol=a.tol,
            density=Path(a.density) if a.density else None,
            lanczos_steps=a.lanczos_steps,
            lanczos_runs=a.lanczos_runs,
            batch_size=a.batch_size,
            device=a.device,
            data_dir=a.data_dir,
        )
        results.append(r)
        top, tr = r["top_eigenvalue"], r["trace"]
        print(
            f"{f}: round {r['round']}, {r['samples']} samples, loss {r['loss']:.4f}: top eigenvalue "
            f"{top['value']:.4g} ({top['iterations']} iterations{'' if top['converged'] else ', not converged'}), "
            f"trace {tr['mean']:.4g} ± {tr['stderr']:.2g} ({tr['probes']} probes)"
            + (f", density in {r['density']['png']}" if "density" in r else "")
        )
    doc: dict[str, Any] = results[0] if len(folders) == 1 and not a.table else {"runs": results}
    if "runs" in doc:
        by = tuple(f.strip() for f in a.by.split(",")) if a.by else ("algorithm", "params")
        doc["by"] = list(by)
        doc["rows"] = analyze.table(results, by)
        doc["commit"] = git_commit()
        print(analyze.markdown(doc["rows"]))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def add_analyze_parser(sub: Any, positive_int: Any, positive: Any) -> None:
    """Registers ``wafl analyze`` and its commands (``flatness``, ``curves``) on the ``wafl`` sub-parsers."""
    an = sub.add_parser("analyze", help="measurements of finished runs' models")
    asub = an.add_subparsers(dest="analysis", required=True)
    f = asub.add_parser(
        "flatness",
        help="top Hessian eigenvalue, Hessian trace (and eigenvalue density) of a run's global model",
        description=analyze.__doc__.split("\n\n")[0] if analyze.__doc__ else None,
    )
    f.add_argument("dirs", nargs="+", metavar="RUN_DIR", help="run folders, or folders holding them (a sweep's)")
    f.add_argument("--checkpoint", help="a checkpoint file of the run (default: RUN_DIR/checkpoint.pt, the last round)")
    f.add_argument(
        "--round",
        type=positive_int,
        help="the checkpoint of this round, RUN_DIR/checkpoints/round-R.pt (kept with keep_checkpoint_every)",
    )
    f.add_argument("--samples", type=positive_int, help="a seeded sample of this many training points (default: all)")
    f.add_argument("--sample-seed", dest="sample_seed", type=int, default=0, help="seed of the sample and probes")
    f.add_argument("--probes", type=positive_int, default=100, help="Rademacher probes of the trace (default 100)")
    f.add_argument("--max-iter", dest="max_iter", type=positive_int, default=100, help="power iterations at most")
    f.add_argument("--tol", type=positive, default=1e-3, help="relative change that ends the power iteration")
    f.add_argument("--density", metavar="PNG", help="also draw the eigenvalue density (Lanczos quadrature) here")
    f.add_argument("--lanczos-steps", dest="lanczos_steps", type=positive_int, default=90)
    f.add_argument("--lanczos-runs", dest="lanczos_runs", type=positive_int, default=1)
    f.add_argument("--batch-size", dest="batch_size", type=positive_int, default=256)
    f.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    f.add_argument(
        "--threads",
        type=positive_int,
        help="torch threads on the CPU (default: torch's, one a core; 1 is faster beside other work)",
    )
    f.add_argument("--data-dir", dest="data_dir", help="where the run's dataset is on this machine")
    f.add_argument("--by", help="with several runs: fields that make the rows (default: algorithm,params)")
    f.add_argument("--table", action="store_true", help="a table even for one run")
    f.add_argument("--json", help="write the measurements (and table) as JSON here")
    f.set_defaults(fn=cmd_flatness)
    _add_curves(asub)


def cmd_curves(a: argparse.Namespace) -> int:
    def skipped(folder: Path, why: str) -> None:
        print(f"wafl analyze curves: leaving out {folder}: {why}", file=sys.stderr)

    try:
        runs = find_runs([Path(p) for p in a.dirs], on_skip=skipped)
    except TableError as e:
        raise UsageError(str(e)) from None
    runs = curves.select(runs, a.where)
    if not runs:
        raise UsageError(f"no run matches --where {' '.join(a.where)}")
    by = tuple(f.strip() for f in a.by.split(",")) if a.by else DEFAULT_BY
    metrics = [m.strip() for m in a.metrics.split(",")]
    if a.panels and a.against:
        raise UsageError("--panels draws curves against rounds: leave it out with --against")
    doc = curves.curves(runs, by, metrics, (a.against,) if a.against else (), a.panels)
    missing = [m for m in metrics if not any(e[m]["round"] for e in doc.values())]
    if missing:
        raise UsageError(f"no run has values of {', '.join(missing)} in its results.jsonl")
    result: dict[str, Any] = {"by": list(by), "panels": a.panels, "where": list(a.where), "metrics": metrics}
    result["groups"] = doc
    if a.against:
        if len(metrics) != 1:
            raise UsageError("--against draws one metric: give one in --metrics")
        result["against"] = a.against
        result["reduce"] = a.reduce
        result["points"] = curves.plot_against(doc, metrics[0], a.against, Path(a.out), a.title, a.reduce)
    else:
        curves.plot_curves(doc, metrics, Path(a.out), a.title, a.panels)
    for name, entry in doc.items():
        last = {m: (f"{entry[m]['mean'][-1]:.4g}" if entry[m]["round"] else "-") for m in metrics}
        print(f"{name} ({len(entry['seeds'])} runs): last " + ", ".join(f"{m} {v}" for m, v in last.items()))
    print(f"wafl analyze curves: drawn in {a.out}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _add_curves(asub: Any) -> None:
    c = asub.add_parser("curves", help="results fields against rounds (or a setting), mean over seeds, as a PNG")
    c.add_argument("dirs", nargs="+", help="run folders or folders holding them (a sweep's)")
    c.add_argument("--metrics", default="gm_accuracy,pm_accuracy", help="results fields, comma-separated")
    c.add_argument("--by", help="fields that make the curves (default: algorithm,params); params.NAME for one")
    c.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE", help="keep these runs; repeatable")
    c.add_argument("--against", metavar="FIELD", help="draw each curve's mean over rounds against this setting")
    c.add_argument(
        "--reduce",
        choices=["mean", "last"],
        default="mean",
        help="--against: each run's mean over its rounds or its last value (default mean)",
    )
    c.add_argument(
        "--panels", metavar="FIELD", help="one row of panels per value of this field (e.g. num_clients, base_algorithm)"
    )
    c.add_argument("--title", default="")
    c.add_argument("--out", required=True, help="the PNG")
    c.add_argument("--json", help="also write the numbers drawn here")
    c.set_defaults(fn=cmd_curves)

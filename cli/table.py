"""``wafl table``: the table of an FL paper from run folders.

Every run folder (``config.json`` + ``results.jsonl``, as ``wafl run``, ``wafl sweep`` and the
in-process runs write them) is one run. Runs are grouped into rows by a label (default: the
algorithm and its parameters; ``--by`` names other fields), and each metric column shows the
mean +- population standard deviation over the row's seeds with the min-max spread:

* ``final_gm`` / ``best_gm``: the last / highest ``gm_accuracy`` of the run;
* ``final_pm`` / ``best_pm``: the same for ``pm_accuracy`` (rows without a PM show ``-``);
* ``final_local`` / ``best_local``: the same for ``local_accuracy``, the models the clients just
  trained on their local test sets (the FedHKD paper's local accuracy; ``-`` for methods with a
  personal phase, whose ``pm_accuracy`` it is);
* ``time_to_target``: seconds from the first model's publication until ``gm_accuracy`` first
  reaches ``--target`` (a run that never does counts as missing);
* ``mbytes``: megabytes that crossed the network (``bytes_up + bytes_down`` over the rounds);
* ``epsilon``: the run's differential-privacy epsilon, for methods that report one (FedHKD with
  ``sigma > 0``: the last round's ``epsilon``, a client that took part in every round);
* ``final_new`` / ``best_new``: the same as ``final_gm`` for ``new_client_accuracy``, the clients held out of
  training after adapting the global model (``new_clients``); only in tables of runs that have them.

With ``--baseline LABEL`` every other row gets, per metric, the paired difference to the
baseline on the same seeds: mean (min to max). Runs whose settings differ in anything but the
seed and the fields that make the rows are refused, naming the fields and their values.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS = (
    "final_gm",
    "best_gm",
    "final_pm",
    "best_pm",
    "final_local",
    "best_local",
    "time_to_target",
    "mbytes",
    "epsilon",
)
NEW_CLIENTS = ("final_new", "best_new")  # in a table only when one of its runs held clients out (new_clients)
KNOWN = METRICS + NEW_CLIENTS
PERCENT = {"final_gm", "best_gm", "final_pm", "best_pm", "final_local", "best_local", *NEW_CLIENTS}
DEFAULT_BY = ("algorithm", "params")


class TableError(ValueError):
    """The runs cannot make one table; the message says why."""


@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    commit: str | None = None  # the code's commit, where the run folder records it (a sweep's point.json)


def unfinished(folder: Path, config: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str | None:
    """Why a run folder is not a finished run (None when it is): a sweep point without ``point.json``
    (running, interrupted or failed), or fewer results rows than the configured rounds."""
    if not (folder / "point.json").exists() and any(folder.parent.glob("*/point.json")):
        return "a sweep point that has not finished"
    rounds = config.get("rounds")
    last = max((int(r.get("round", 0)) for r in rows), default=0)
    if isinstance(rounds, int) and last < rounds:
        return f"results up to round {last} of {rounds}"
    return None


def find_runs(paths: Iterable[Path], on_skip: Callable[[Path, str], None] | None = None) -> list[Run]:
    """Every finished run folder at or below ``paths`` (a folder with ``config.json`` and ``results.jsonl``);
    unfinished ones (see :func:`unfinished`) are left out and passed to ``on_skip`` with the reason."""
    found: list[Run] = []
    for p in paths:
        if not p.is_dir():
            raise TableError(f"{p} is not a folder")
        folders = sorted({c.parent for c in p.rglob("config.json")} | ({p} if (p / "config.json").exists() else set()))
        for f in folders:
            if not (f / "results.jsonl").exists():
                continue
            rows = [json.loads(line) for line in (f / "results.jsonl").read_text().splitlines() if line.strip()]
            config = json.loads((f / "config.json").read_text())
            why = unfinished(f, config, rows)
            if why is not None:
                if on_skip is not None:
                    on_skip(f, why)
                continue
            point = f / "point.json"
            commit = json.loads(point.read_text()).get("commit") if point.exists() else None
            found.append(Run(f, config, rows, commit))
    if not found:
        raise TableError(f"no finished run folders (config.json + results.jsonl) under {', '.join(map(str, paths))}")
    return found


def label(config: Mapping[str, Any], by: Sequence[str]) -> str:
    """A row's name: the algorithm, its parameters, then any other ``by`` field as ``field=value``."""
    parts = []
    for field in by:
        value = config.get(field)
        if field == "params":
            if value:
                parts.append(", ".join(f"{k}={v}" for k, v in sorted(value.items())))
        elif field == "algorithm":
            parts.append(str(value))
        else:
            parts.append(f"{field}={value}")
    return " ".join(parts) or "run"


def check_comparable(runs: Sequence[Run], by: Sequence[str]) -> None:
    """Refuses runs that differ in anything but ``seed`` and ``by``. A field a run's ``config.json``
    lacks (it predates the field) counts as the field's default."""
    from wafl.common.config import RunConfig

    defaults = json.loads(RunConfig().to_json())
    free = {"seed", *by}
    differing: dict[str, set[str]] = {}
    first = runs[0].config
    for r in runs[1:]:
        for k in set(first) | set(r.config):
            if k in free:
                continue
            a, b = first.get(k, defaults.get(k)), r.config.get(k, defaults.get(k))
            if a != b:
                differing.setdefault(k, set()).update({json.dumps(a), json.dumps(b)})
    if differing:
        what = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(differing.items()))
        raise TableError(
            f"the runs differ in more than {', '.join(sorted(free))}: {what} "
            "(add those fields to --by, or pass runs of one setting)"
        )


def run_metrics(run: Run, target: float) -> dict[str, float | None]:
    rows = run.rows
    gm = [r["gm_accuracy"] for r in rows if r.get("gm_accuracy") is not None]
    pm = [r["pm_accuracy"] for r in rows if r.get("pm_accuracy") is not None]
    local = [r["local_accuracy"] for r in rows if r.get("local_accuracy") is not None]
    new = [r["new_client_accuracy"] for r in rows if r.get("new_client_accuracy") is not None]
    t0 = float(rows[0]["wall_s"]) - float(rows[0].get("round_s") or 0.0) if rows else 0.0
    reach = next((float(r["wall_s"]) - t0 for r in rows if (r.get("gm_accuracy") or 0.0) >= target - 1e-12), None)
    traffic = sum((r.get("bytes_up") or 0) + (r.get("bytes_down") or 0) for r in rows)
    return {
        "final_gm": gm[-1] if gm else None,
        "best_gm": max(gm) if gm else None,
        "final_pm": pm[-1] if pm else None,
        "best_pm": max(pm) if pm else None,
        "final_local": local[-1] if local else None,
        "best_local": max(local) if local else None,
        "time_to_target": reach,
        "mbytes": traffic / 1e6 if rows else None,
        "epsilon": next((float(r["epsilon"]) for r in reversed(rows) if r.get("epsilon") is not None), None),
        "final_new": new[-1] if new else None,
        "best_new": max(new) if new else None,
    }


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": len(values)}


def build(
    runs: Sequence[Run], by: Sequence[str] = DEFAULT_BY, target: float = 0.9, baseline: str | None = None
) -> dict[str, Any]:
    """The table as data: ``rows`` (label -> metric -> stats, seeds, runs) and ``differences``."""
    check_comparable(runs, by)
    grouped: dict[str, dict[int, dict[str, float | None]]] = {}
    folders: dict[str, list[str]] = {}
    for r in runs:
        name = label(r.config, by)
        seed = int(r.config.get("seed", 0))
        if seed in grouped.setdefault(name, {}):
            raise TableError(f"two runs of {name!r} with seed {seed}: {folders[name]} and {r.path}")
        grouped[name][seed] = run_metrics(r, target)
        folders.setdefault(name, []).append(str(r.path))
    metrics: tuple[str, ...] = METRICS
    if any(v["final_new"] is not None for per_seed in grouped.values() for v in per_seed.values()):
        metrics += NEW_CLIENTS
    table: dict[str, Any] = {}
    for name, per_seed in grouped.items():
        table[name] = {
            "seeds": sorted(per_seed),
            "runs": folders[name],
            **{m: _stats([x for v in per_seed.values() if (x := v[m]) is not None]) for m in metrics},
        }
    diffs: dict[str, Any] = {}
    if baseline is not None:
        if baseline not in grouped:
            raise TableError(f"--baseline {baseline!r} is not a row; rows: {sorted(grouped)}")
        base = grouped[baseline]
        for name, per_seed in grouped.items():
            if name == baseline:
                continue
            common = sorted(set(per_seed) & set(base))
            diffs[name] = {
                m: _stats(
                    [a - b for s in common if (a := per_seed[s][m]) is not None and (b := base[s][m]) is not None]
                )
                for m in metrics
            }
    commits = sorted({r.commit for r in runs if r.commit})
    return {
        "by": list(by),
        "target": target,
        "baseline": baseline,
        "commits": commits,
        "rows": table,
        "differences": diffs,
    }


def _cell(stats: Mapping[str, float] | None, metric: str, signed: bool = False) -> str:
    if not stats:
        return "-"
    scale = 100.0 if metric in PERCENT else 1.0
    digits = 1 if metric in PERCENT or metric == "time_to_target" else 2
    f = (lambda v: f"{scale * v:+.{digits}f}") if signed else (lambda v: f"{scale * v:.{digits}f}")
    if signed:
        return f"{f(stats['mean'])} ({f(stats['min'])} to {f(stats['max'])})"
    return f"{f(stats['mean'])} ± {scale * stats['std']:.{digits}f} ({f(stats['min'])}–{f(stats['max'])})"


def markdown(doc: Mapping[str, Any], metrics: Sequence[str] = KNOWN) -> str:
    titles = {
        "final_gm": "final GM acc. (%)",
        "best_gm": "best GM acc. (%)",
        "final_pm": "final PM acc. (%)",
        "best_pm": "best PM acc. (%)",
        "final_local": "final local acc. (%)",
        "best_local": "best local acc. (%)",
        "time_to_target": f"s to GM {doc['target']:g}",
        "mbytes": "MB moved",
        "epsilon": "DP epsilon",
        "final_new": "final new-client acc. (%)",
        "best_new": "best new-client acc. (%)",
    }
    shown = [m for m in metrics if any(r.get(m) for r in doc["rows"].values())]
    head = ["run", "seeds", *[titles[m] for m in shown]]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(shown)]
    for name, r in doc["rows"].items():
        lines.append("| " + " | ".join([name, str(len(r["seeds"])), *[_cell(r.get(m), m) for m in shown]]) + " |")
    if doc["differences"]:
        lines += ["", f"Paired differences to {doc['baseline']} on the same seeds: mean (min to max).", ""]
        lines.append("| run | " + " | ".join(titles[m] for m in shown) + " |")
        lines.append("|---|" + "---:|" * len(shown))
        for name, d in doc["differences"].items():
            lines.append("| " + " | ".join([name, *[_cell(d.get(m), m, signed=True) for m in shown]]) + " |")
    return "\n".join(lines)


def main(
    paths: Sequence[str],
    by: str | None,
    target: float,
    baseline: str | None,
    json_out: str | None,
    metrics: str | None = None,
) -> int:
    def skipped(folder: Path, why: str) -> None:
        print(f"wafl table: leaving out {folder}: {why}", file=sys.stderr)

    runs = find_runs([Path(p) for p in paths], on_skip=skipped)
    fields = tuple(f.strip() for f in by.split(",")) if by else DEFAULT_BY
    shown = tuple(m.strip() for m in metrics.split(",")) if metrics else KNOWN
    unknown = [m for m in shown if m not in KNOWN]
    if unknown:
        raise TableError(f"--metrics: unknown {', '.join(unknown)}; known: {', '.join(KNOWN)}")
    doc = build(runs, fields, target, baseline)
    print(markdown(doc, shown))
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0

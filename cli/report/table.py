"""``wafl table``: the table of an FL paper from run folders.

Every run folder (``config.json`` + ``results.jsonl``, as ``wafl run``, ``wafl sweep`` and the
in-process runs write them) is one run. Runs are grouped into rows by a label (default: the
algorithm and its parameters; ``--by`` names other fields), and each metric column shows the
mean +- population standard deviation over the row's seeds with the min-max spread:

* ``final_gm`` / ``best_gm``: the last / highest ``gm_accuracy`` of the run;
* ``mean_last_gm``: the mean ``gm_accuracy`` over the run's last 10 evaluated rounds (all of them where it
  has fewer; :data:`LAST`), the final accuracy of a curve that still wobbles (likewise ``mean_last_pm``,
  ``mean_last_local`` and ``mean_last_new`` for the metrics below);
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

Runs with the plateau rule (``plateau_window``, :mod:`wafl.common.plateau`) add a ``stopped`` column:
how many of the row's runs stopped on the plateau (and at which rounds) and how many reached ``rounds``
without flattening (their last results line's ``stop_reason``).

With ``--baseline LABEL`` every other row gets, per metric, the paired difference to the
baseline on the same seeds: mean (min to max). With ``--within FIELDS`` too (fields of ``--by``, e.g.
``num_clients``), each row is paired with the baseline's row at its own values of those fields, and LABEL
names the baseline without them (``--by algorithm,params,num_clients --within num_clients --baseline fedavg``:
each client count's rows against FedAvg at that count; a count whose baseline has not run gets no
differences, listed as ``unpaired``). Then, for the final and last-10 accuracies, two
verdicts per row and metric, with the paired differences ``d_1..d_n`` of the ``n`` common seeds:

* the seeds' rule (the claims list's): ``better`` when every ``d_i > 0``, ``worse`` when every
  ``d_i < 0``, ``inconclusive`` otherwise and always with one seed;
* the 95 % interval over seeds, ``mean(d) +- t_{0.975, n-1} * s / sqrt(n)`` with ``s`` the sample
  standard deviation (``n - 1`` in its denominator) and ``t`` Student's quantile (:func:`t975`):
  ``better`` / ``worse`` when the whole interval lies above / below 0, ``inconclusive`` when it holds
  0 and with one seed (no interval). With equal differences on every seed the interval is that value.

Runs whose settings differ in anything but the seed and the fields that make the rows are refused,
naming the fields and their values.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wafl.common.config import RunConfig
from wafl.common.plateau import MAX_ROUNDS, PLATEAU

METRICS = (
    "final_gm",
    "best_gm",
    "mean_last_gm",
    "final_pm",
    "best_pm",
    "mean_last_pm",
    "final_local",
    "best_local",
    "mean_last_local",
    "time_to_target",
    "mbytes",
    "epsilon",
)
# in a table only when one of its runs held clients out (new_clients)
NEW_CLIENTS = ("final_new", "best_new", "mean_last_new")
KNOWN = METRICS + NEW_CLIENTS
PERCENT = {m for m in KNOWN if m.startswith(("final_", "best_", "mean_last_"))}
VERDICTS = tuple(m for m in KNOWN if m.startswith(("final_", "mean_last_")))  # the accuracies judged
DEFAULT_BY = ("algorithm", "params")
LAST = 10  # mean_last_*: the evaluated rounds averaged

# Student's t quantile t_{0.975, df} for df = 1..30 (scipy.stats.t.ppf(0.975, df), 6 decimals)
T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
    2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
    2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip
Z975 = 1.959963984540054  # the normal quantile


def t975(df: int) -> float:
    """Student's t quantile t_{0.975, df}: :data:`T975` up to 30 degrees of freedom, beyond them the
    Cornish-Fisher expansion in 1/df to its fourth term (within 3e-8 of the exact value for df > 30)."""
    if df < 1:
        raise ValueError(f"t quantile: df={df} must be at least 1")
    if df <= len(T975):
        return T975[df - 1]
    z = Z975
    g = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(gi / df ** (i + 1) for i, gi in enumerate(g))


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
    (running, interrupted or failed), or fewer results rows than the configured rounds without a last
    row that stopped on the plateau (``stop_reason``)."""
    if not (folder / "point.json").exists() and any(folder.parent.glob("*/point.json")):
        return "a sweep point that has not finished"
    rounds = config.get("rounds")
    last = max((int(r.get("round", 0)) for r in rows), default=0)
    if isinstance(rounds, int) and last < rounds and not (rows and rows[-1].get("stop_reason") == PLATEAU):
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


def _mean_last(values: Sequence[float], last: int) -> float | None:
    """The mean of the last ``last`` values (all of them where there are fewer); None for none."""
    tail = list(values)[-last:]
    return sum(tail) / len(tail) if tail else None


def run_metrics(run: Run, target: float, last: int = LAST) -> dict[str, float | None]:
    """A run's metrics (module docstring); the ``mean_last_*`` ones over its last ``last`` evaluated rounds."""
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
        "mean_last_gm": _mean_last(gm, last),
        "final_pm": pm[-1] if pm else None,
        "best_pm": max(pm) if pm else None,
        "mean_last_pm": _mean_last(pm, last),
        "final_local": local[-1] if local else None,
        "best_local": max(local) if local else None,
        "mean_last_local": _mean_last(local, last),
        "time_to_target": reach,
        "mbytes": traffic / 1e6 if rows else None,
        "epsilon": next((float(r["epsilon"]) for r in reversed(rows) if r.get("epsilon") is not None), None),
        "final_new": new[-1] if new else None,
        "best_new": max(new) if new else None,
        "mean_last_new": _mean_last(new, last),
    }


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": len(values)}


def _verdicts(values: Sequence[float]) -> dict[str, Any]:
    """The paired differences' 95 % interval over seeds and both verdicts (module docstring)."""
    n = len(values)
    seeds = "inconclusive"
    if n >= 2 and all(v > 0 for v in values):
        seeds = "better"
    elif n >= 2 and all(v < 0 for v in values):
        seeds = "worse"
    if n < 2:
        return {"ci95": None, "seeds_verdict": seeds, "interval_verdict": "inconclusive"}
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    low, high = mean - half, mean + half
    interval = "better" if low > 0 else "worse" if high < 0 else "inconclusive"
    return {"ci95": [low, high], "seeds_verdict": seeds, "interval_verdict": interval}


def paired(differences: Sequence[float]) -> dict[str, Any] | None:
    """Paired differences over seeds as the table judges them: mean, std, min, max and n, then the 95 %
    interval and both verdicts (module docstring); None for none."""
    stats: dict[str, Any] | None = _stats(differences)
    if stats is not None:
        stats.update(_verdicts(differences))
    return stats


def _stopped(stops: Sequence[tuple[str | None, int]]) -> dict[str, Any] | None:
    """How a row's runs ended under the plateau rule: counts and the rounds of those that flattened
    (None when none of them ran with the rule)."""
    if all(reason is None for reason, _ in stops):
        return None
    flat = sorted(r for reason, r in stops if reason == PLATEAU)
    return {
        "plateau": len(flat),
        "max_rounds": sum(reason == MAX_ROUNDS for reason, _ in stops),
        "runs": len(stops),
        "plateau_rounds": flat,
    }


def build(
    runs: Sequence[Run],
    by: Sequence[str] = DEFAULT_BY,
    target: float = 0.9,
    baseline: str | None = None,
    last: int = LAST,
    within: Sequence[str] = (),
) -> dict[str, Any]:
    """The table as data: ``rows`` (label -> metric -> stats, seeds, runs, how they stopped) and
    ``differences`` (label -> metric -> stats of the paired differences, with the 95 % interval and
    both verdicts for the accuracies of :data:`VERDICTS`); ``paired_with`` (label -> the baseline row it was
    paired with) and, with ``within``, ``unpaired`` (the rows whose values of ``within`` the baseline lacks)."""
    outside = [f for f in within if f not in by]
    if outside:
        raise TableError(f"--within {','.join(outside)}: not among the fields that make the rows (--by {','.join(by)})")
    if within and baseline is None:
        raise TableError("--within pairs rows with the baseline: give --baseline too")
    check_comparable(runs, by)
    rest = [f for f in by if f not in within]
    grouped: dict[str, dict[int, dict[str, float | None]]] = {}
    folders: dict[str, list[str]] = {}
    stops: dict[str, list[tuple[str | None, int]]] = {}
    place: dict[str, tuple[str, str]] = {}  # label -> (its label without ``within``, its ``within`` values)
    for r in runs:
        name = label(r.config, by)
        place[name] = (label(r.config, rest), json.dumps([r.config.get(f) for f in within]))
        seed = int(r.config.get("seed", 0))
        if seed in grouped.setdefault(name, {}):
            raise TableError(f"two runs of {name!r} with seed {seed}: {folders[name]} and {r.path}")
        grouped[name][seed] = run_metrics(r, target, last)
        folders.setdefault(name, []).append(str(r.path))
        end = r.rows[-1] if r.rows else {}
        stops.setdefault(name, []).append((end.get("stop_reason"), int(end.get("round", 0))))
    metrics: tuple[str, ...] = METRICS
    if any(v["final_new"] is not None for per_seed in grouped.values() for v in per_seed.values()):
        metrics += NEW_CLIENTS
    table: dict[str, Any] = {}
    for name, per_seed in grouped.items():
        table[name] = {
            "seeds": sorted(per_seed),
            "runs": folders[name],
            "stopped": _stopped(stops[name]),
            **{m: _stats([x for v in per_seed.values() if (x := v[m]) is not None]) for m in metrics},
        }
    diffs: dict[str, Any] = {}
    paired_with: dict[str, str] = {}
    unpaired: list[str] = []
    if baseline is not None:
        bases = {place[n][1]: n for n in grouped if place[n][0] == baseline}
        if not bases:
            rows = sorted({place[n][0] for n in grouped})
            where = f" (without {','.join(within)})" if within else ""
            raise TableError(f"--baseline {baseline!r} is not a row{where}; rows: {rows}")
        for name, per_seed in grouped.items():
            if place[name][0] == baseline:
                continue
            if place[name][1] not in bases:
                unpaired.append(name)
                continue
            paired_with[name] = bases[place[name][1]]
            base = grouped[paired_with[name]]
            common = sorted(set(per_seed) & set(base))
            diffs[name] = {}
            for m in metrics:
                values = [a - b for s in common if (a := per_seed[s][m]) is not None and (b := base[s][m]) is not None]
                diffs[name][m] = paired(values) if m in VERDICTS else _stats(values)
    commits = sorted({r.commit for r in runs if r.commit})
    return {
        "by": list(by),
        "target": target,
        "last": last,
        "baseline": baseline,
        "within": list(within),
        "commits": commits,
        "rows": table,
        "differences": diffs,
        "paired_with": paired_with,
        "unpaired": unpaired,
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


def _stopped_cell(stopped: Mapping[str, Any] | None) -> str:
    if not stopped:
        return "-"
    n, flat = stopped["runs"], stopped["plateau_rounds"]
    parts = []
    if flat:
        at = f"round {flat[0]}" if flat[0] == flat[-1] else f"rounds {flat[0]}–{flat[-1]}"
        parts.append(f"plateau {len(flat)}/{n} ({at})")
    if stopped["max_rounds"]:
        parts.append(f"max, not flat {stopped['max_rounds']}/{n}")
    return ", ".join(parts) or "-"


def _interval_cell(stats: Mapping[str, Any]) -> str:
    ci = stats.get("ci95")
    return "-" if ci is None else f"[{100.0 * ci[0]:+.1f}, {100.0 * ci[1]:+.1f}]"


def markdown(doc: Mapping[str, Any], metrics: Sequence[str] = KNOWN) -> str:
    last = doc.get("last", LAST)
    titles = {
        "final_gm": "final GM acc. (%)",
        "best_gm": "best GM acc. (%)",
        "mean_last_gm": f"GM acc., mean of last {last} (%)",
        "final_pm": "final PM acc. (%)",
        "best_pm": "best PM acc. (%)",
        "mean_last_pm": f"PM acc., mean of last {last} (%)",
        "final_local": "final local acc. (%)",
        "best_local": "best local acc. (%)",
        "mean_last_local": f"local acc., mean of last {last} (%)",
        "time_to_target": f"s to GM {doc['target']:g}",
        "mbytes": "MB moved",
        "epsilon": "DP epsilon",
        "final_new": "final new-client acc. (%)",
        "best_new": "best new-client acc. (%)",
        "mean_last_new": f"new-client acc., mean of last {last} (%)",
    }
    shown = [m for m in metrics if any(r.get(m) for r in doc["rows"].values())]
    stops = any(r.get("stopped") for r in doc["rows"].values())
    head = ["run", "seeds", *(["stopped"] if stops else []), *[titles[m] for m in shown]]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + ("---|" if stops else "") + "---:|" * len(shown)]
    for name, r in doc["rows"].items():
        stop = [_stopped_cell(r.get("stopped"))] if stops else []
        lines.append(
            "| " + " | ".join([name, str(len(r["seeds"])), *stop, *[_cell(r.get(m), m) for m in shown]]) + " |"
        )
    within = doc.get("within") or []
    at = f" at the same {', '.join(within)}" if within else ""
    if doc.get("unpaired"):
        lines += ["", f"No baseline{at} yet, so no paired differences: {', '.join(doc['unpaired'])}."]
    if doc["differences"]:
        lines += ["", f"Paired differences to {doc['baseline']}{at} on the same seeds: mean (min to max).", ""]
        lines.append("| run | " + " | ".join(titles[m] for m in shown) + " |")
        lines.append("|---|" + "---:|" * len(shown))
        for name, d in doc["differences"].items():
            lines.append("| " + " | ".join([name, *[_cell(d.get(m), m, signed=True) for m in shown]]) + " |")
        judged = [m for m in shown if m in VERDICTS]
        verdicts = [(name, m, d[m]) for name, d in doc["differences"].items() for m in judged if d.get(m)]
        if verdicts:
            lines += [
                "",
                f"Verdicts against {doc['baseline']}{at} (points, on the seeds both have): the seeds' rule says better "
                "(worse) when the difference is above (below) 0 on every seed; the interval is the 95 % interval "
                "over seeds, mean ± t(0.975, n−1)·s/√n, and says better (worse) when it lies above (below) 0; "
                "either is inconclusive otherwise and with one seed.",
                "",
                "| run | metric | seeds | difference | 95 % interval | seeds' rule | interval |",
                "|---|---|---:|---:|---:|---|---|",
            ]
            for name, m, st in verdicts:
                cells = [
                    name,
                    titles[m].removesuffix(" (%)"),
                    str(st["n"]),
                    _cell(st, m, signed=True),
                    _interval_cell(st),
                    st["seeds_verdict"],
                    st["interval_verdict"],
                ]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(
    paths: Sequence[str],
    by: str | None,
    target: float,
    baseline: str | None,
    json_out: str | None,
    metrics: str | None = None,
    within: str | None = None,
) -> int:
    def skipped(folder: Path, why: str) -> None:
        print(f"wafl table: leaving out {folder}: {why}", file=sys.stderr)

    runs = find_runs([Path(p) for p in paths], on_skip=skipped)
    fields = tuple(f.strip() for f in by.split(",")) if by else DEFAULT_BY
    shown = tuple(m.strip() for m in metrics.split(",")) if metrics else KNOWN
    unknown = [m for m in shown if m not in KNOWN]
    if unknown:
        raise TableError(f"--metrics: unknown {', '.join(unknown)}; known: {', '.join(KNOWN)}")
    pairs = tuple(f.strip() for f in within.split(",")) if within else ()
    doc = build(runs, fields, target, baseline, within=pairs)
    print(markdown(doc, shown))
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0

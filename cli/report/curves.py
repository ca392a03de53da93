"""``wafl analyze curves``: results-row fields against rounds (or against a setting) over many runs.

The run folders are found as ``wafl table`` finds them (finished runs at or below the folders
given). ``--where FIELD=VALUE`` keeps the runs with that setting, ``--by FIELDS`` makes the
curves (default: algorithm and parameters, as ``wafl table``'s rows); a field is a configuration
field or ``params.NAME``, an algorithm parameter. Each curve is the mean over the runs of its
group (their seeds) at every round where the field has a value, with the min-max band; one
panel per ``--metrics`` field (``gm_accuracy``, ``pm_accuracy``, ``grad_dissimilarity``, any
numeric column of ``results.jsonl``). ``--against FIELD`` draws instead each group's value of the
metric (each run's mean over its rounds, or with ``--reduce last`` its last value, averaged over
the group) against that (numeric) setting, e.g. G_d against ASD's lambda. ``--panels FIELD`` draws
one row of panels per value of that field (e.g. ``num_clients``, or ``base_algorithm``: a row for
FedAvg, FedAvg+ASD and its variants, the next for FedProx and its), the curves named without it, so
that a table over several settings stays readable; a curve keeps its colour and line style in every
row. ``--json`` writes the numbers drawn, so a figure can be checked against its runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from wafl.cli.report.table import Run, label
from wafl.common.errors import UsageError

# fields computed from a run's configuration, usable wherever a configuration field is;
# base_algorithm: the algorithm without its regularizer (fedavg for fedavg and fedavg+asd)
DERIVED: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "base_algorithm": lambda config: str(config.get("algorithm", "")).split("+")[0],
}


def with_derived(config: Mapping[str, Any]) -> dict[str, Any]:
    """The configuration with the :data:`DERIVED` fields added."""
    return {**config, **{name: derive(config) for name, derive in DERIVED.items()}}


def field(config: Mapping[str, Any], name: str) -> Any:
    """A configuration field, ``params.NAME`` for an algorithm parameter, or a :data:`DERIVED` field
    (None when absent)."""
    if name.startswith("params."):
        return (config.get("params") or {}).get(name[len("params.") :])
    if name in DERIVED:
        return DERIVED[name](config)
    return config.get(name)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def select(runs: Sequence[Run], where: Sequence[str]) -> list[Run]:
    """The runs whose every ``FIELD=VALUE`` of ``where`` holds (numbers compare as numbers)."""
    conds = []
    for w in where:
        if "=" not in w:
            raise UsageError(f"--where {w!r} is not FIELD=VALUE")
        k, v = w.split("=", 1)
        conds.append((k.strip(), _parse_value(v)))

    def holds(config: Mapping[str, Any], k: str, v: Any) -> bool:
        got = field(config, k)
        if isinstance(got, (int, float)) and isinstance(v, (int, float)) and not isinstance(got, bool):
            return math.isclose(float(got), float(v), rel_tol=1e-9, abs_tol=1e-12)
        return got == v

    return [r for r in runs if all(holds(r.config, k, v) for k, v in conds)]


def group_label(config: Mapping[str, Any], by: Sequence[str]) -> str:
    """``wafl table``'s label for its fields; ``params.NAME`` fields as ``NAME=VALUE``."""
    plain = [b for b in by if not b.startswith("params.")]
    parts = [label(with_derived(config), plain)] if plain else []
    parts += [f"{b[len('params.') :]}={field(config, b)}" for b in by if b.startswith("params.")]
    return " ".join(parts)


def _number(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def curves(
    runs: Sequence[Run],
    by: Sequence[str],
    metrics: Sequence[str],
    settings: Sequence[str] = (),
    panels: str | None = None,
) -> dict[str, Any]:
    """label -> seeds, runs, the ``by`` and ``settings`` fields' values and, per metric, the rounds with the
    mean, min and max over the runs. With ``panels``, the groups are also split by that field: each entry
    has its ``panel`` value and its ``name``, the label without the panel field."""
    keys = (*by, panels) if panels and panels not in by else tuple(by)
    named = [b for b in keys if b != panels]
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(group_label(r.config, keys), []).append(r)
    out: dict[str, Any] = {}
    for name, members in groups.items():
        first = members[0].config
        entry: dict[str, Any] = {
            "name": (group_label(first, named) if named else "all") if panels else name,
            "panel": field(first, panels) if panels else None,
            "seeds": sorted(int(r.config.get("seed", 0)) for r in members),
            "runs": [str(r.path) for r in members],
            "settings": {b: field(first, b) for b in (*keys, *settings) if b != "params"},
        }
        for m in metrics:
            per_round: dict[int, list[float]] = {}
            for r in members:
                for row in r.rows:
                    v = row.get(m)
                    if _number(v):
                        per_round.setdefault(int(row["round"]), []).append(float(v))
            rounds = sorted(per_round)
            entry[m] = {
                "round": rounds,
                "mean": [sum(per_round[k]) / len(per_round[k]) for k in rounds],
                "min": [min(per_round[k]) for k in rounds],
                "max": [max(per_round[k]) for k in rounds],
                "runs_per_round": [len(per_round[k]) for k in rounds],
            }
            per_run = [[float(row[m]) for row in r.rows if _number(row.get(m))] for r in members]
            entry[m]["run_means"] = [sum(v) / len(v) for v in per_run if v]  # each run's mean over its rounds
            entry[m]["run_lasts"] = [v[-1] for v in per_run if v]  # each run's last value
        out[name] = entry
    return out


LINE_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))  # line style and marker, ten colours each


def _order(value: Any) -> tuple[str, Any]:
    """A sort key for panel values of any one type (numbers by value, the rest as text)."""
    return ("0", float(value)) if _number(value) else ("1", str(value))


def plot_curves(
    doc: Mapping[str, Any], metrics: Sequence[str], path: Path, title: str = "", panels: str | None = None
) -> None:
    """One panel per metric; with ``panels``, one row of them per value of that field. A curve's colour and
    line style follow its name (ten colours, then the next line style and marker), the same in every row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    drawn = {k: e for k, e in doc.items() if any(e[m]["round"] for m in metrics)}
    names = list(dict.fromkeys(e["name"] for e in drawn.values()))
    style = {n: (f"C{i % 10}", *LINE_STYLES[(i // 10) % len(LINE_STYLES)]) for i, n in enumerate(names)}
    seeds: dict[str, set[int]] = {}
    for e in drawn.values():
        seeds.setdefault(e["name"], set()).add(len(e["seeds"]))
    rows = sorted({e["panel"] for e in drawn.values()}, key=_order)  # [None] without panels
    # one legend for all panels, below them: a row's label can be long (an algorithm and its parameters)
    ncol = 1 if max((len(n) for n in names), default=0) > 60 or len(metrics) == 1 else 2
    legend_in = 0.15 * (-(-len(names) // ncol)) + 0.3  # inches: a line per row of the legend (7 pt)
    panel_in = 4 if len(rows) == 1 else 3.4
    height = panel_in * len(rows) + legend_in
    fig, axes = plt.subplots(len(rows), len(metrics), figsize=(5.5 * len(metrics), height), squeeze=False)
    handles: dict[str, Any] = {}
    for axrow, value in zip(axes, rows):
        for ax, m in zip(axrow, metrics):
            for entry in drawn.values():
                c = entry[m]
                if not c["round"] or entry["panel"] != value:
                    continue
                name = entry["name"]
                color, ls, mk = style[name]
                (line,) = ax.plot(c["round"], c["mean"], color=color, ls=ls, marker=mk, ms=3)
                handles.setdefault(name, line)
                if any(n > 1 for n in c["runs_per_round"]):
                    ax.fill_between(c["round"], c["min"], c["max"], color=color, alpha=0.12)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylabel(m)
            ax.grid(alpha=0.3)
            if panels:
                ax.set_title(f"{panels}={value}", fontsize=9)
    if handles:
        shown = [n for n in names if n in handles]  # in the order of the styles
        labels = [f"{n} ({'/'.join(str(s) for s in sorted(seeds[n]))})" for n in shown]
        fig.legend([handles[n] for n in shown], labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    top = 1 - 0.3 / height if title else 1  # room for the title above the first row's panel titles
    fig.tight_layout(rect=(0, legend_in / height, 1, top))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_against(
    doc: Mapping[str, Any], metric: str, against: str, path: Path, title: str = "", reduce: str = "mean"
) -> list[list[float]]:
    """Each group's ``metric`` against its ``against`` setting: per run its mean over the rounds
    (``reduce="mean"``) or its last value (``"last"``), then the mean, min and max over the group's runs;
    returns the points ``[x, mean, min, max]`` drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for entry in doc.values():
        x = entry["settings"].get(against)
        vals = entry[metric]["run_means" if reduce == "mean" else "run_lasts"]
        if isinstance(x, (int, float)) and vals:
            points.append([float(x), sum(vals) / len(vals), min(vals), max(vals)])
    if not points:
        raise UsageError(f"--against {against}: no group has a numeric {against} and values of {metric}")
    points.sort()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    xs = [p[0] for p in points]
    ax.errorbar(
        xs,
        [p[1] for p in points],
        yerr=[[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]],
        marker="o",
        capsize=3,
    )
    ax.set_xlabel(against)
    ax.set_ylabel(f"{metric} ({'mean over rounds' if reduce == 'mean' else 'last round'})")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return points

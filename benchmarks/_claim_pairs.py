"""The claims' paired differences of a Fashion-MNIST table (``real_data.py summary``), and how their verdicts
moved from the shorter table its sweep extends.

Each ``#   claims panel "TITLE" METRIC ROW [ROW ...]`` line of a sweep file's header names a claim family: its
first row is the claims' subject, each other row a method it is compared with, on METRIC. Per column value
(the client count, where the header has ``#   claims columns num_clients``) and per other row, the subject
minus that row on each seed both ran, in two readings of a run's accuracy:

* ``mean_last``: the mean of its last 10 evaluated rounds (``wafl table``'s ``mean_last_*``), the final
  accuracy of a plateau table;
* ``final``: its last evaluated round, how the claims list read the 15- and 35-round tables;
* ``at_round`` (given a round R, the shorter table's last): its last evaluated round up to R;
* ``equal_rounds`` (a plateau table, whose runs stop at rounds of their own): on each seed both runs are read
  by the mean of their last 10 evaluated rounds up to the earlier of their two last rounds. The plateau rule
  lets a curve that still gains up to ``plateau_delta`` points a window stop, so a pair whose one run stopped
  hundreds of rounds before the other's compares those rounds too; this reading compares the two methods
  after the same training, and equals ``mean_last`` on a seed whose two runs stopped at the same round.

Each gets ``wafl table``'s statistics and both verdicts (:func:`wafl.cli.report.table.paired`: the seeds' rule
and the 95 % interval over seeds). :func:`moved` sets a plateau table's pairs beside the same pairs of the
shorter table (its ``final`` reading, the one its claims used) and flags each seeds' verdict that changed, and
by what: the plateau runs read at the shorter table's last round tell the rounds (the same runs, read later)
from the runs (the same round of other runs: another machine's kernels, or a fix between the tables) and from
the seeds a plateau table adds to the shorter one's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

# a claims panel's metric -> the suffix of its wafl table columns (final_gm, mean_last_gm, ...)
SUFFIX = {"gm_accuracy": "gm", "pm_accuracy": "pm", "local_accuracy": "local", "new_client_accuracy": "new"}
READINGS = ("mean_last", "final")


class Panel(Protocol):
    """A claims panel (``real_data.ClaimPanel``): its rows are ``real_data.ClaimRow``s (``name``, ``spec`` and
    the ``FIELD=VALUE`` conditions, ``where``, that pick their runs)."""

    title: str
    metric: str
    rows: list[Any]


def value_at(run: Any, metric: str, at_round: int) -> float | None:
    """``metric`` at the run's last evaluated round up to ``at_round`` (None when none is)."""
    values = [r[metric] for r in run.rows if r.get(metric) is not None and int(r["round"]) <= at_round]
    return float(values[-1]) if values else None


def mean_last_upto(run: Any, metric: str, upto: int) -> float | None:
    """``wafl table``'s mean of the last 10 evaluated values of ``metric`` (``mean_last``) over the run's rounds
    up to ``upto`` (None when none is evaluated)."""
    from wafl.cli.report.table import Run, run_metrics

    head = Run(run.path, run.config, [r for r in run.rows if int(r["round"]) <= upto])
    return run_metrics(head, target=1.0)[f"mean_last_{SUFFIX[metric]}"]


def last_round(run: Any) -> int:
    return int(run.rows[-1]["round"]) if run.rows else 0


def seed_values(
    runs: Sequence[Any], metric: str, what: str, at_round: int | None = None
) -> dict[int, dict[str, float]]:
    """Seed -> its readings of ``metric`` (module docstring: ``mean_last``, ``final`` and, given ``at_round`` and
    a round evaluated up to it, ``at_round``) for the runs of one table row; a seed twice means the row picks
    several table rows and is refused, naming ``what``."""
    from wafl.cli.report.table import run_metrics

    suffix = SUFFIX[metric]
    out: dict[int, dict[str, float]] = {}
    for run in runs:
        m = run_metrics(run, target=1.0)
        last, final = m[f"mean_last_{suffix}"], m[f"final_{suffix}"]
        if last is None or final is None:
            continue
        seed = int(run.config.get("seed", 0))
        if seed in out:
            raise SystemExit(
                f"real_data: {what} picks two runs of seed {seed}: add a FIELD=VALUE that tells them apart"
            )
        out[seed] = {"mean_last": last, "final": final}
        then = value_at(run, metric, at_round) if at_round is not None else None
        if then is not None:
            out[seed]["at_round"] = then
    return out


def runs_by_column(records: Mapping[str, Mapping[str, Any]], columns: str | None) -> tuple[list[Any], list[Any]]:
    """The kept ``records`` as ``wafl table`` runs, and the values of ``columns`` they hold, sorted (one None
    without columns): what the claims figure and the claims' pairs iterate over."""
    from wafl.cli.report.curves import field
    from wafl.cli.report.table import Run

    runs = [Run(Path(n), dict(r["config"]), list(r["rows"])) for n, r in sorted(records.items())]
    values = sorted({field(r.config, columns) for r in runs}, key=lambda v: (str(type(v)), v)) if columns else [None]
    return runs, values


def claim_pairs(
    panels: Sequence[Panel],
    columns: str | None,
    records: Mapping[str, Mapping[str, Any]],
    at_round: int | None = None,
    equal_rounds: bool = False,
) -> list[dict[str, Any]]:
    """Every panel's subject minus each of its other rows, per value of ``columns`` (or once), on the seeds
    both have, in each reading (module docstring; ``at_round`` only given a round, on the seeds both evaluated
    by then; ``equal_rounds`` where asked, with the round each seed was read at, ``equal_rounds_round``); a pair
    with no common seed yet has ``seeds`` [] and no statistics. Differences in points (accuracy x 100)."""
    from wafl.cli.report.curves import field, select
    from wafl.cli.report.table import paired

    runs, values = runs_by_column(records, columns)
    out: list[dict[str, Any]] = []
    for panel in panels:
        if panel.metric not in SUFFIX:
            raise SystemExit(
                f"real_data: claims panel {panel.title!r}: no pairs for {panel.metric!r}; known: {list(SUFFIX)}"
            )
        subject, *others = panel.rows
        for value in values:
            here = [r for r in runs if columns is None or field(r.config, columns) == value]
            picked = select(here, subject.where)
            a = seed_values(picked, panel.metric, f"claims row {subject.spec!r}", at_round)
            a_runs = {int(r.config.get("seed", 0)): r for r in picked}
            for other in others:
                chosen = select(here, other.where)
                b = seed_values(chosen, panel.metric, f"claims row {other.spec!r}", at_round)
                b_runs = {int(r.config.get("seed", 0)): r for r in chosen}
                seeds = sorted(set(a) & set(b))
                pair: dict[str, Any] = {
                    "panel": panel.title,
                    "metric": panel.metric,
                    "column": columns,
                    "value": value,
                    "subject": subject.name,
                    "other": other.name,
                    "seeds": seeds,
                }
                for reading in READINGS + (("at_round",) if at_round is not None else ()):
                    both = [s for s in seeds if reading in a[s] and reading in b[s]]
                    diffs = [100.0 * (a[s][reading] - b[s][reading]) for s in both]
                    pair[reading] = paired(diffs)
                    pair[f"{reading}_by_seed"] = dict(zip(map(str, both), diffs))
                if at_round is not None:
                    pair["round"] = at_round
                if equal_rounds:
                    diffs, upto = {}, {}
                    for s in seeds:
                        r = min(last_round(a_runs[s]), last_round(b_runs[s]))
                        x, y = mean_last_upto(a_runs[s], panel.metric, r), mean_last_upto(b_runs[s], panel.metric, r)
                        if x is not None and y is not None:
                            diffs[str(s)], upto[str(s)] = 100.0 * (x - y), r
                    pair["equal_rounds"] = paired(list(diffs.values()))
                    pair["equal_rounds_by_seed"] = diffs
                    pair["equal_rounds_round"] = upto
                out.append(pair)
    return out


def _key(pair: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (pair["panel"], repr(pair["value"]), pair["subject"], pair["other"])


def moved(after: Sequence[Mapping[str, Any]], before: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each pair of ``after`` (a plateau table, read by ``mean_last``) with the same pair of ``before`` (the
    shorter table, read by ``final``): ``changed`` when both have statistics and their seeds' verdicts differ
    (the rule the claims list applies), ``interval_changed`` likewise for the interval's verdicts.

    Where the plateau pair has its ``at_round`` reading (the shorter table's last round), ``changed_by`` says
    which steps from the shorter table's seeds' verdict to the plateau's moved it, each step changing one thing:
    ``runs`` (the shorter table against the plateau runs at the same round, on the seeds both ran:
    ``at_round_same_seeds``), ``seeds`` (the plateau runs at that round on those seeds against all of theirs) and
    ``rounds`` (the plateau runs at that round against their plateau); any of them, or none."""
    from wafl.cli.report.table import paired

    earlier = {_key(p): p for p in before}
    out = []
    for p in after:
        q = earlier.get(_key(p))
        now, then, mid = p.get("mean_last"), (q or {}).get("final"), p.get("at_round")
        entry = {**p, "before": then, "before_seeds": (q or {}).get("seeds", [])}
        entry["changed"] = bool(now and then and now["seeds_verdict"] != then["seeds_verdict"])
        entry["interval_changed"] = bool(now and then and now["interval_verdict"] != then["interval_verdict"])
        by = []
        if now and then and mid:
            shared = {str(s) for s in entry["before_seeds"]}
            same = paired([d for s, d in p.get("at_round_by_seed", {}).items() if s in shared])
            entry["at_round_same_seeds"] = same
            steps = [then, same or mid, mid, now]
            for name, (x, y) in zip(("runs", "seeds", "rounds"), zip(steps, steps[1:])):
                if x["seeds_verdict"] != y["seeds_verdict"]:
                    by.append(name)
        entry["changed_by"] = by
        out.append(entry)
    return out


def _difference(stats: Mapping[str, Any] | None) -> str:
    if not stats:
        return "-"
    return f"{stats['mean']:+.1f} ({stats['min']:+.1f} to {stats['max']:+.1f})"


def _interval(stats: Mapping[str, Any] | None) -> str:
    ci = (stats or {}).get("ci95")
    return "-" if ci is None else f"[{ci[0]:+.1f}, {ci[1]:+.1f}]"


NAMES = {"runs": "the runs", "seeds": "the added seeds", "rounds": "the rounds"}


def markdown(pairs: Sequence[Mapping[str, Any]], before_name: str | None, before_rounds: str | None) -> list[str]:
    """The table.md section of the claims' pairs (with the shorter table's columns where ``before_name``, and the
    plateau runs at its last round where the pairs have that reading)."""
    if not pairs:
        return []
    column = pairs[0]["column"]
    at = next((p["round"] for p in pairs if p.get("round") is not None), None)
    equal = any("equal_rounds" in p for p in pairs)
    head = ["claim family", *([column] if column else []), "pair", "seeds", "difference", "95 % interval"]
    head += ["seeds' rule", "interval"]
    align = ["---", *(["---:"] if column else []), "---", "---:", "---:", "---:", "---", "---"]
    lines = [
        "Claims' pairs (the header's `claims panel` lines: each panel's first row minus each other row"
        + (f", at equal {column}" if column else "")
        + "; points, on the seeds both have; the mean of each seed's last 10 evaluated rounds, verdicts as above).",
    ]
    if equal:
        head += ["at equal rounds", "its seeds' rule"]
        align += ["---:", "---"]
        lines[0] += (
            " At equal rounds: on each seed both runs read by the mean of their last 10 evaluated rounds up to the "
            "earlier of their two stops, the two methods after the same training (the rule lets a curve that "
            "still gains a little stop, so runs that stop hundreds of rounds apart compare those rounds too)."
        )
    if before_name:
        head += [f"{before_name}, last round ({before_rounds})", "its seeds' rule"]
        align += ["---:", "---"]
        lines[0] += (
            f" Beside each, the same pair in `{before_name}` by its last round, as the claims list read it, and "
            "whether the seeds' verdict changed."
        )
        if at is not None:
            head += [f"these runs at round {at}", "their seeds' rule"]
            align += ["---:", "---"]
            lines[0] += (
                f" The same runs read at round {at} tell what changed it: the rounds (their verdict at round {at} "
                f"is `{before_name}`'s and the plateau's is not), the runs (round {at} of these runs and of "
                f"`{before_name}`'s differ in verdict on the seeds both ran: other kernels or a fix between the "
                f"tables) or the added seeds (these runs at round {at} on `{before_name}`'s seeds and on all of "
                "theirs differ in verdict)."
            )
        head += ["changed"]
        align += ["---"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for p in pairs:
        now = p.get("mean_last")
        cells = [p["panel"], *([str(p["value"])] if column else []), f"{p['subject']} − {p['other']}"]
        cells += [str(len(p["seeds"])), _difference(now), _interval(now)]
        cells += [now["seeds_verdict"], now["interval_verdict"]] if now else ["not yet run", "-"]
        if equal:
            same = p.get("equal_rounds")
            cells += [_difference(same), same["seeds_verdict"] if same else "-"]
        if before_name:
            then = p.get("before")
            cells += [_difference(then), then["seeds_verdict"] if then else "-"]
            if at is not None:
                mid = p.get("at_round")
                cells += [_difference(mid), mid["seeds_verdict"] if mid else "-"]
            by = " and ".join(NAMES[b] for b in p.get("changed_by") or ())
            flag = "**yes**" + (f": {by}" if by else "")
            cells += [flag if p.get("changed") else ("no" if now and then else "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]

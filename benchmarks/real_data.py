"""The Fashion-MNIST tables (configs/sweeps/*_fmnist*.toml): run a sweep across several sittings, keep
the record of every finished point in the repository, and make the table and the curves from those
records.

A table's sweep takes hours, longer than a machine may stay up. What ``wafl table`` and ``wafl analyze
curves`` read of a finished point is small: its configuration (``config.json``), one row of metrics a
round (``results.jsonl``) and ``point.json`` (the commit and the point's wall-clock); the per-process
logs and reports are not kept. ``save`` packs those of every finished point into one file a sweep,
``benchmarks/results/real-data/<sweep>/records.json`` (a point a line, merged with the points it
already holds); ``restore`` unpacks them into a sweep's output folder, byte for byte as the run wrote
them, so ``wafl sweep`` skips those points; ``run`` restores, runs the rest, then saves. A point of a method
with both models that stopped when the plateau rule watched its PM alone is not restored: it runs again, and
``save`` replaces its record.

    python benchmarks/real_data.py run configs/sweeps/scd_fmnist.toml --out /tmp/sweeps/scd_fmnist --jobs 2
    python benchmarks/real_data.py save configs/sweeps/scd_fmnist.toml --out /tmp/sweeps/scd_fmnist
    python benchmarks/real_data.py summary configs/sweeps/scd_fmnist.toml
    python benchmarks/real_data.py run configs/sweeps/scd_fmnist.toml --out /tmp/sweeps/scd_fmnist \\
        --rerun 'algorithm=pfedme,*'     # after a fix that changes those rows: their records are dropped first

``verify`` runs kept points again from the sweep file, in process as ``wafl sweep`` does (``--point GLOB``,
repeatable; a temporary folder unless ``--out``), and compares each new ``results.jsonl`` with the kept rows,
timing fields aside (``*_s``, ``timestamp``, ``run_id``), and the new ``config.json`` with the kept one (fields the
kept one lacks, added to ``RunConfig`` since, must hold their defaults): a committed table's numbers come back
bit for bit from its sweep file on a fresh clone, or the first differing round and field is named (exit 1).

    python benchmarks/real_data.py verify configs/sweeps/asd_fmnist.toml --point 'algorithm=fedavg,seed=0'

A plateau table's point takes an hour or more; ``--rounds N`` runs and compares its first N rounds only (the run
goes on a round or two windows past them, so that their evaluations are the point's own, ``prefix_rounds``):

    python benchmarks/real_data.py verify configs/sweeps/fedhkd_fmnist_plateau.toml --rounds 40 \\
        --point 'algorithm=fedhkd,num_clients=10,params.delta=0.01,seed=0'

``summary`` unpacks the records into ``runs/real-data/<sweep>`` (a scratch folder, rewritten each time)
and writes ``table.md`` (the commands, the commits, the points done and missing, the plateau rule the
points ran with, if any, then ``wafl table``'s markdown: the last-10 means, how the points stopped, the
paired differences with their 95 % intervals and verdicts), ``table.json`` and ``curves.png`` /
``curves.json`` (accuracy against rounds, mean and min-max over the seeds) beside ``records.json``. The
table's ``--by`` and ``--baseline`` are the ones the sweep file's header gives (its ``#   wafl table ...``
line); while the baseline's points are not all done the paired differences are left out and the text
says so. Each ``#   wafl analyze curves ...``
command of the header (a figure the sweep exists for: new-client accuracy, G_d against rounds or
lambda, a sensitivity curve) is run too, on the unpacked records, its ``--out`` and ``--json`` files
written beside ``records.json`` under their own names.

The claim-family figure, ``claims.png`` (and ``claims.json``, the numbers drawn), is drawn from the header's
``#   claims panel "TITLE" METRIC ROW [ROW ...]`` lines (a trailing backslash continues one), a panel each:
METRIC a results field (``gm_accuracy``, ``pm_accuracy``, ``local_accuracy``, ``new_client_accuracy``), each ROW
``[NAME:]SELECTOR`` a curve, SELECTOR comma-separated ``FIELD=VALUE`` conditions (as ``wafl analyze curves
--where``) or bare words (the algorithm), e.g. ``"SCD-GM only:scd,params.lambda_p=0.0"``; a row must pick the runs
of one table row, the first row (the claim's subject) is drawn in black. ``#   claims columns FIELD`` draws each
panel once per value of FIELD (``num_clients``), side by side. Each curve is the mean over its seeds (those that
reached the round) with the min-max band, its legend gives the table's final accuracy (the mean of each seed's
last 10 evaluated rounds) and how its seeds stopped; a seed that stopped on the plateau gets a triangle at its
last value and a dotted line at its round, one that reached the maximum without flattening a cross; where every
run of a panel ends on the same rounds (a sweep without the plateau rule) the last 10 are shaded.

The same panels, and the header's ``#   claims pair "TITLE" METRIC ROW ROW...`` lines (comparisons a claim
needs that no panel draws), give the claims' pairs (``benchmarks/_claim_pairs.py``): each one's first row minus
each other row, per column value, seed by seed, with ``wafl table``'s interval and both verdicts, written to
``claims-pairs.json`` and as a section of ``table.md``. A sweep that ``extends`` a table with kept records (a
plateau table) sets each pair beside the same pair of that shorter table, read by its last round as the
claims list read it, flags each seeds' verdict that changed and says by what: the plateau runs read at that
table's last round tell the rounds (the same runs read later) from the runs (that round's verdict differs
between the two tables' runs on the seeds both ran) and from the seeds the plateau table adds. A plateau table's
pairs are also read at equal rounds: on each seed both runs up to the earlier of their two stops.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wafl.common.jsonsafe import dumps

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks._claim_pairs when this file runs as a script
RESULTS = ROOT / "benchmarks" / "results" / "real-data"
RECORD = ("config.json", "results.jsonl", "point.json")  # a point's files that a record holds
FIELDS = ("config", "rows", "point")  # the same, as a record's fields


def records_file(sweep_file: Path) -> Path:
    """Where a sweep's kept records live by default: benchmarks/results/real-data/<sweep>/records.json."""
    return RESULTS / sweep_file.stem / "records.json"


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (as the committed texts name it)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def table_args(sweep_file: Path) -> list[str]:
    """The ``wafl table`` options after the folder on the sweep file's ``#   wafl table DIR ...`` line."""
    found = header_commands(sweep_file, "wafl table")
    return found[0][1:] if found else []


def header_commands(sweep_file: Path, command: str = "wafl analyze curves") -> list[list[str]]:
    """The header's ``#   <command> ...`` lines (a trailing backslash continues one on the next comment
    line), each split into its arguments after ``command``; a file without any takes those of the sweep it
    extends (``extends = "other.toml"``: the same table and claim families, run longer)."""
    found: list[str] = []
    current: str | None = None
    for line in sweep_file.read_text().splitlines():
        if not line.startswith("#"):
            break  # the header ends at the first line that is not a comment
        text = line.lstrip("#").strip()
        if current is None and not text.startswith(command + " "):
            continue
        part = text.removesuffix("\\").strip()
        current = part if current is None else f"{current} {part}"
        if not text.endswith("\\"):
            found.append(current)
            current = None
    n = len(shlex.split(command))
    if not found:
        parent = tomllib.loads(sweep_file.read_text()).get("extends")
        if isinstance(parent, str):
            return header_commands(sweep_file.parent / parent, command)
    return [shlex.split(c, comments=True)[n:] for c in found]


def figure_args(args: list[str], sweep_out: str, work: str, here: Path) -> list[str]:
    """A header's curves command for the records unpacked in ``work``: the sweep's folder becomes
    ``work``, ``--out`` and ``--json`` files go into ``here`` under their own names."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if i > 0 and args[i - 1] in ("--out", "--json"):
            out.append(_shown(here / Path(arg).name))
        elif arg.rstrip("/") == sweep_out.rstrip("/"):
            out.append(work)
        else:
            out.append(arg)
    return out


def points(sweep_file: Path) -> list[str]:
    from wafl.cli.experiments.sweep import load_sweep

    return [name for name, _ in load_sweep(sweep_file)[1]]


def load_sweep_configs(sweep_file: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every point of the sweep file as (name, its configuration as ``config.json`` holds it)."""
    from wafl.cli.experiments.sweep import load_sweep

    return [(name, json.loads(cfg.to_json())) for name, cfg in load_sweep(sweep_file)[1]]


def load_out(sweep_file: Path) -> Path:
    """The sweep file's ``out`` folder (as it names it)."""
    from wafl.cli.experiments.sweep import load_sweep

    return load_sweep(sweep_file)[0]


def pack(folder: Path) -> dict[str, Any]:
    """A finished point's record: the contents of its three files."""
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
    return {
        "config": json.loads((folder / "config.json").read_text()),
        "rows": rows,
        "point": json.loads((folder / "point.json").read_text()),
    }


def unpack(record: dict[str, Any], folder: Path) -> None:
    """Writes a record's three files into ``folder`` as the run wrote them (the engine's ``config.json``,
    the results log's rows, the sweep's ``point.json``), so a pack/unpack round trip gives the same bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(dumps(record["config"], indent=2))
    (folder / "results.jsonl").write_text("".join(dumps(r) + "\n" for r in record["rows"]))
    (folder / "point.json").write_text(json.dumps(record["point"]) + "\n")


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """The kept records, point name -> record ({} when the file does not exist yet)."""
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    recs = doc.get("points") if isinstance(doc, dict) else None
    if not isinstance(recs, dict):
        raise SystemExit(f"real_data: {_shown(path)} has no 'points' object: not a records file")
    return recs


def write_records(path: Path, records: dict[str, dict[str, Any]]) -> None:
    """One point a line (sorted), so a new point is a one-line change; written whole, then renamed."""
    body = ",\n".join(f"  {json.dumps(n)}: {dumps(records[n], sort_keys=False)}" for n in sorted(records))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text('{"points": {\n' + body + "\n}}\n")
    tmp.replace(path)


def incomplete(record: dict[str, Any]) -> list[str]:
    """The fields a record lacks or holds empty (a point has at least one row and a finished point.json)."""
    return [f for f in FIELDS if not record.get(f)]


def changed_points(sweep_file: Path, records: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """The complete ``records`` of points that ran with another configuration than ``sweep_file`` gives them
    now (the file or a default changed since), each with its changes
    (:func:`~wafl.cli.experiments.sweep.config_changes`)."""
    from wafl.cli.experiments.sweep import config_changes

    now = dict(load_sweep_configs(sweep_file))
    found = {}
    for name, record in records.items():
        if name in now and not incomplete(dict(record)):
            changes = config_changes(dict(record["config"]), now[name])
            if changes:
                found[name] = changes
    return found


def restore(kept: Path, out: Path, sweep_file: Path | None = None) -> int:
    """Unpacks the kept records into ``out`` (points already finished there are left as they are). A kept
    point that lacks a field, that stopped under the earlier plateau rule (:func:`earlier_rule`), or (given the
    ``sweep_file``) that ran with another configuration than the file gives it now (a changed file or default:
    :func:`~wafl.cli.experiments.sweep.config_changes`) is named on stderr and not restored, so the sweep runs
    it again (and ``save`` replaces its record)."""
    n = 0
    records = read_records(kept)
    earlier = set(earlier_rule({k: r for k, r in records.items() if not incomplete(r)}))
    stale = changed_points(sweep_file, records) if sweep_file is not None else {}
    for name, record in sorted(records.items()):
        dst = out / name
        if (dst / "point.json").exists():
            continue
        lacks = incomplete(record)
        changed = stale.get(name, [])
        if lacks or name in earlier or changed:
            why = (
                f"lacks {', '.join(lacks)}"
                if lacks
                else f"ran with another configuration ({'; '.join(changed)})"
                if changed
                else "stopped under the earlier plateau rule (the PM alone)"
            )
            print(f"real_data: {name} in {_shown(kept)} {why}: not restored, it runs again", file=sys.stderr)
            continue
        if dst.exists():
            shutil.rmtree(dst)  # an unfinished attempt: its files are replaced by the finished record
        unpack(record, dst)
        n += 1
    return n


def drop(sweep_file: Path, out: Path, kept: Path, patterns: list[str]) -> list[str]:
    """Forgets the points whose names match one of ``patterns`` (``fnmatch``, e.g. ``algorithm=pfedme,*``):
    their kept records and their folders in ``out``, so that ``run`` runs them again (after a fix that
    changes their rows). Returns the names dropped; a pattern that matches no point of the sweep is an error."""
    from wafl.cli.experiments.sweep import matching
    from wafl.common.config import ConfigError

    try:
        chosen = matching(points(sweep_file), patterns, "--rerun")
    except ConfigError as e:
        raise SystemExit(f"real_data: {e} ({_shown(sweep_file)})") from None
    records = read_records(kept)
    for name in chosen:
        records.pop(name, None)
        if (out / name).exists():
            shutil.rmtree(out / name)
    write_records(kept, records)
    return chosen


def save(sweep_file: Path, out: Path, kept: Path) -> int:
    """Packs the record of every finished point of ``out`` into ``kept`` (merged with what it holds)."""
    records = read_records(kept)
    n = 0
    for name in points(sweep_file):
        src = out / name
        if not (src / "point.json").exists():
            continue
        missing = [f for f in RECORD if not (src / f).is_file()]
        if missing:
            raise SystemExit(f"real_data: {src} is marked finished but lacks {', '.join(missing)}")
        records[name] = pack(src)
        n += 1
    write_records(kept, records)
    return n


UNTIMED = ("timestamp", "run_id")  # with every field ending in _s: what differs between two runs of one point


def untimed(row: Mapping[str, Any]) -> dict[str, Any]:
    """A results row without the fields that measure time (they differ between two runs of one point)."""
    return {k: v for k, v in row.items() if not (k.endswith("_s") or k in UNTIMED)}


def differences(kept: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], config: Mapping[str, Any]) -> list[str]:
    """How a new run of a point differs from its kept record (empty: the same numbers): the rows timing fields
    aside, then the configuration (:func:`~wafl.cli.experiments.sweep.config_changes`)."""
    from wafl.cli.experiments.sweep import config_changes

    found = []
    old = [untimed(r) for r in kept["rows"]]
    new = [untimed(r) for r in rows]
    if len(old) != len(new):
        found.append(f"{len(new)} rows, the kept record has {len(old)}")
    for a, b in zip(old, new):
        if a != b:
            fields = sorted(k for k in set(a) | set(b) if a.get(k, "(none)") != b.get(k, "(none)"))
            found.append(f"round {a.get('round')}: " + ", ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in fields))
            break
    found.extend(f"config {c}" for c in config_changes(kept["config"], dict(config)))
    return found


def prefix_rounds(config: Mapping[str, Any], first: int) -> int | None:
    """How many rounds a run of the point ``config`` (its flat ``config.json``) needs so that its first ``first``
    rounds are the point's own, evaluations included; None where that is the whole point.

    A run's evaluation schedule depends on its last round (:meth:`RunConfig.evaluates
    <wafl.common.config.RunConfig.evaluates>`: the last round, and with the plateau rule every one of the last
    ``2 * plateau_window``), so the shorter run goes on past the compared rounds: one round, or ``2 *
    plateau_window`` where the point evaluates only every ``eval_every`` rounds; and it runs at least the
    ``2 * plateau_window`` rounds the rule needs. Nothing else a point computes depends on its round count."""
    if first < 1:
        raise ValueError(f"--rounds must be at least 1 (got {first})")
    window, every = int(config.get("plateau_window") or 0), int(config.get("eval_every", 1))
    tail = 2 * window if window and every != 1 else 1
    rounds = max(first + tail, 2 * window)
    return rounds if rounds < int(config["rounds"]) else None


def verify(
    sweep_file: Path, kept: Path, patterns: Sequence[str], out: Path, first: int | None = None
) -> dict[str, list[str]]:
    """Runs the kept points that match ``patterns`` again into ``out`` (in process, as ``wafl sweep`` runs them:
    each in a fresh interpreter with the sweep's kernels, ``point_kernels``) and returns each one's
    :func:`differences` from its record. A pattern that matches no kept point is an error. ``first``: only the
    point's first ``first`` rounds are run (a few more, :func:`prefix_rounds`) and compared, for the points of
    the plateau tables that take an hour or more."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from wafl.cli.experiments.sweep import load_sweep, point_kernels, run_point
    from wafl.common.config import RunConfig

    records = read_records(kept)
    configs = dict(load_sweep(sweep_file)[1])
    chosen: list[str] = []
    for pattern in patterns:
        match = [n for n in configs if fnmatch.fnmatchcase(n, pattern) and n in records]
        if not match:
            raise SystemExit(f"real_data: --point {pattern!r} matches no kept point of {_shown(sweep_file)}")
        chosen += [n for n in match if n not in chosen]
    found = {}
    for name in chosen:
        folder = out / name
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        record, cfg = records[name], configs[name]
        rounds = prefix_rounds(record["config"], first) if first else None
        if rounds is not None:  # the first rounds only: the record cut to them, its round count the run's
            cfg = RunConfig.from_json(json.dumps({**json.loads(cfg.to_json()), "rounds": rounds}))
            record = {**record, "config": {**record["config"], "rounds": rounds}, "rows": record["rows"][:first]}
        print(f"real_data: verify {name}" + (f", its first {first} rounds" if rounds else ""), file=sys.stderr)
        with point_kernels(), ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            result = pool.submit(run_point, cfg.to_json(), str(folder), False).result()
        rows = [json.loads(x) for x in (folder / "results.jsonl").read_text().splitlines() if x.strip()]
        if rounds is not None:
            rows = rows[:first]
        diff = differences(record, rows, json.loads((folder / "config.json").read_text()))
        found[name] = diff if result["ok"] else ["the point did not finish", *diff]
        print(f"real_data: {name}: " + ("the same numbers" if not found[name] else "; ".join(found[name])),
              file=sys.stderr)  # fmt: skip
    return found


WAFL = str(Path(sys.executable).parent / "wafl")  # the command of the environment this runs in


def _wafl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WAFL, *args], capture_output=True, text=True, cwd=ROOT)


def without_baseline(args: Sequence[str]) -> list[str]:
    """``wafl table`` arguments less ``--baseline`` and ``--within`` (which pairs rows with the baseline), each
    with its value: the table of a sweep whose baseline has no finished point yet."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--baseline", "--within"):
            skip = True
        else:
            out.append(a)
    return out


def summary(sweep_file: Path, kept: Path, work: Path | None = None) -> Path:
    """table.md, table.json, curves.png and curves.json beside ``kept``, from its records unpacked into
    ``work`` (default ``runs/real-data/<sweep>``, emptied first)."""
    names = points(sweep_file)
    records = read_records(kept)
    changed = changed_points(sweep_file, records)  # kept, but not what the sweep file runs now: left out
    done = [n for n in names if n in records and not incomplete(records[n]) and n not in changed]
    if not done:
        why = (
            f": the {len(changed)} kept point(s) ran with another configuration than the sweep file gives them now "
            f"({'; '.join(n + ': ' + ', '.join(cs) for n, cs in sorted(changed.items()))}); run the sweep again"
            if changed
            else ""
        )
        raise SystemExit(f"real_data: no finished points of {_shown(sweep_file)} in {_shown(kept)}{why}")
    work = work or ROOT / "runs" / "real-data" / sweep_file.stem
    if work.exists():
        shutil.rmtree(work)
    for n in done:
        unpack(records[n], work / n)
    here = kept.parent
    rel = _shown(work)
    args = table_args(sweep_file)
    note = ""
    res = _wafl("table", rel, *args, "--json", _shown(here / "table.json"))
    if res.returncode != 0 and "--baseline" in args and "is not a row" in res.stderr:
        i = args.index("--baseline")
        note = f"The baseline {args[i + 1]!r} has no finished point yet: no paired differences.\n\n"
        args = without_baseline(args)
        res = _wafl("table", rel, *args, "--json", _shown(here / "table.json"))
    if res.returncode != 0:
        raise SystemExit(f"real_data: wafl table failed: {res.stderr.strip()}")
    commits = json.loads((here / "table.json").read_text())["commits"]
    missing = [n for n in names if n not in done]
    by = args[args.index("--by") + 1] if "--by" in args else "algorithm,params"
    rows = [r for n in done for r in records[n]["rows"]]
    fields = ("gm_accuracy", "pm_accuracy", "local_accuracy", "new_client_accuracy")
    metrics = ",".join(f for f in fields if any(r.get(f) is not None for r in rows))
    panels = []
    if "num_clients" in by.split(","):
        panels = ["--panels", "num_clients"]  # a row per client count
    elif any("+" in str(records[n]["config"].get("algorithm", "")) for n in done):
        panels = ["--panels", "base_algorithm"]  # a row per base method, with its +ASD variants
    curves = _wafl(
        "analyze", "curves", rel, "--by", by, "--metrics", metrics, *panels,
        "--title", f"{sweep_file.stem}: accuracy against rounds (mean, min-max over seeds)",
        "--out", _shown(here / "curves.png"), "--json", _shown(here / "curves.json"),
    )  # fmt: skip
    if curves.returncode != 0:
        raise SystemExit(f"real_data: wafl analyze curves failed: {curves.stderr.strip()}")
    figures = []
    sweep_out = str(load_out(sweep_file))
    for header_args in header_commands(sweep_file):
        fig_args = figure_args(header_args, sweep_out, rel, here)
        res_fig = _wafl("analyze", "curves", *fig_args)
        if res_fig.returncode != 0:
            raise SystemExit(f"real_data: wafl analyze curves {shlex.join(fig_args)} failed: {res_fig.stderr.strip()}")
        figures.append(f"`wafl analyze curves {shlex.join(fig_args)}`")
    if claims_figure(sweep_file, {n: records[n] for n in done}, by.split(","), here):
        figures.append(
            f"`{CLAIMS_FIGURE}`, `{CLAIMS_JSON}`: one panel per claim family (the header's `claims panel` lines), "
            "the plateau marked"
        )
    pairs_text = claims_pairs_section(sweep_file, {n: records[n] for n in done}, here)
    sweep = _shown(sweep_file)
    text = [
        f"`wafl table {rel} {shlex.join(args)}` over the points of `{_shown(kept)}` "
        f"(`python benchmarks/real_data.py restore {sweep} --out {rel}` unpacks them; the runs: "
        f"`wafl sweep {sweep} --jobs 2`, in process, "
        f"at commit{'s' if len(commits) > 1 else ''} {', '.join(c[:7] for c in commits)}).",
        "",
        f"Points done: {len(done)} of {len(names)}."
        + (f" Not yet run: {', '.join(f'`{m}`' for m in missing)}." if missing else ""),
        "",
        *changed_note(changed),
        *plateau_note(records[done[0]]["config"], {n: records[n] for n in done}),
        note + res.stdout.strip(),
        "",
        *pairs_text,
    ]
    if figures:
        text += ["Figures (the sweep file's header commands, on the same records):", ""]
        text += [f"* {f}" for f in figures] + [""]
    (here / "table.md").write_text("\n".join(text))
    return here


def changed_note(changed: Mapping[str, list[str]]) -> list[str]:
    """A paragraph naming the kept points that ran with another configuration than the sweep file gives them
    now (:func:`changed_points`): they are left out of the table until their new runs replace them."""
    if not changed:
        return []
    kinds = sorted({c.split(":")[0] for cs in changed.values() for c in cs})
    first = next(iter(changed.values()))[0]
    return [
        f"{len(changed)} kept point(s) ran with another configuration than the sweep file gives them now "
        f"({', '.join(f'`{k}`' for k in kinds)}; e.g. {first}): they are left out of the table and run again, and "
        f"their new records replace them: {', '.join(f'`{n}`' for n in sorted(changed))}.",
        "",
    ]


def plateau_note(config: dict[str, Any], records: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """A paragraph on the plateau rule a sweep's points ran with (none without one), naming the ``records``
    that stopped under the earlier ``auto`` rule (:func:`earlier_rule`)."""
    w = config.get("plateau_window") or 0
    if not w:
        return []
    metric = config.get("plateau_metric", "auto")
    watched = (
        "watched accuracies (the GM where it is evaluated and the PM where the method has one) had each"
        if metric == "auto"
        else f"`{metric}`"
    )
    z = config.get("plateau_z") or 0
    room = f" with room for {z:g} standard errors of the difference" if z else ""
    text = [
        f"Each point stopped once its {watched} flattened (its mean over the last {w} rounds within "
        f"{config.get('plateau_delta', 0.3):g} points of the {w} before{room}; `common/plateau.py`) or at round "
        f"{config.get('rounds')}, the maximum: the `stopped` column says which. Accuracies are evaluated "
        f"every {config.get('eval_every', 1)} round(s) and every round over the last {2 * w} before the maximum.",
        "",
    ]
    earlier = earlier_rule(records or {})
    if earlier:
        text += [
            f"{len(earlier)} point(s) of methods with both models stopped under the earlier `auto` rule, which "
            "watched the PM alone, so their GM may still have been rising (their results lines have "
            "`plateau_gap`, not `plateau_gap_gm` and `plateau_gap_pm`); they are run again under the current "
            f"rule: {', '.join(f'`{n}`' for n in earlier)}.",
            "",
        ]
    return text


def earlier_rule(records: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The points whose ``plateau_metric = "auto"`` watched the PM alone although they have a GM too: the rule
    before it watched both (their lines name one ``plateau_gap``)."""
    found = []
    for name, rec in records.items():
        rows = rec["rows"]
        if rec["config"].get("plateau_metric", "auto") != "auto" or not rec["config"].get("plateau_window"):
            continue
        both = any(r.get("gm_accuracy") is not None for r in rows) and any(
            r.get("pm_accuracy") is not None for r in rows
        )
        if both and any("plateau_gap" in r for r in rows):
            found.append(name)
    return found


# The claim-family figure (claims.png): the sweep file's ``#   claims panel "TITLE" METRIC ROW [ROW ...]`` lines
CLAIMS_FIGURE, CLAIMS_JSON = "claims.png", "claims.json"


@dataclass
class ClaimRow:
    """A curve of a claims panel: its name in the legend and the ``FIELD=VALUE`` conditions that pick its runs."""

    name: str
    spec: str
    where: list[str]


@dataclass
class ClaimPanel:
    title: str
    metric: str
    rows: list[ClaimRow]


def claim_row(spec: str) -> ClaimRow:
    """``[NAME:]SELECTOR``: the selector's comma-separated conditions are ``FIELD=VALUE`` (as ``wafl analyze
    curves --where``: a configuration field, ``params.NAME`` or ``base_algorithm``) or a bare word, the
    algorithm; the name is the selector's text unless given before a colon."""
    head, sep, tail = spec.partition(":")
    name, selector = (head, tail) if sep and "=" not in head and head.strip() else (spec, spec)
    where = [c.strip() if "=" in c else f"algorithm={c.strip()}" for c in selector.split(",") if c.strip()]
    if not where:
        raise SystemExit(f"real_data: claims row {spec!r} selects nothing (give FIELD=VALUE or an algorithm)")
    return ClaimRow(name.strip(), spec, where)


def claim_panels(sweep_file: Path, command: str = "claims panel") -> tuple[list[ClaimPanel], str | None]:
    """The header's claims panels, in order, and its ``#   claims columns FIELD`` (None without one). With
    ``command="claims pair"``: the ``#   claims pair "TITLE" METRIC ROW ROW...`` lines, comparisons of the
    claims' pairs (:func:`claims_pairs_section`) that are not drawn."""
    panels = []
    for args in header_commands(sweep_file, command):
        if len(args) < 3:
            raise SystemExit(f'real_data: {_shown(sweep_file)}: a {command} needs "TITLE" METRIC ROW...: {args}')
        title, metric, *specs = args
        panels.append(ClaimPanel(title, metric, [claim_row(s) for s in specs]))
    columns = header_commands(sweep_file, "claims columns")
    if len(columns) > 1 or (columns and len(columns[0]) != 1):
        raise SystemExit(f"real_data: {_shown(sweep_file)}: one '#   claims columns FIELD' line at most")
    return panels, (columns[0][0] if columns else None)


def _stop(run: Any, metric: str) -> dict[str, Any]:
    """How a run ended (its last results line's ``stop_reason``: ``plateau``, ``max_rounds`` or None without
    the plateau rule), the round it ended at and its last value of ``metric`` (%)."""
    from wafl.cli.report.curves import _number

    end = run.rows[-1] if run.rows else {}
    valued = [r for r in run.rows if _number(r.get(metric))]
    return {
        "seed": int(run.config.get("seed", 0)),
        "stop_reason": end.get("stop_reason"),
        "round": int(end.get("round", 0)),
        "value_round": int(valued[-1]["round"]) if valued else None,
        "value": 100.0 * float(valued[-1][metric]) if valued else None,
    }


def claims_data(
    panels: Sequence[ClaimPanel],
    columns: str | None,
    records: Mapping[str, Mapping[str, Any]],
    by: Sequence[str],
    sweep_configs: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The numbers a claims figure draws: per panel and column value (``columns``' values, or one ``None``),
    per row the mean, min and max over its runs (seeds) of ``metric`` at every round (in %), how each run
    stopped (:func:`_stop`), the mean of the runs' means over their last :data:`~wafl.cli.report.table.LAST`
    evaluated rounds (the table's final accuracy) and, where every run of the subplot ends on the same
    rounds, that common window. A row must pick the runs of one table row (``by``) per column; a row that
    picks no finished run is listed under ``missing`` when some point of the sweep (``sweep_configs``)
    matches it, and refused when none does."""
    from wafl.cli.report.curves import curves, field, select
    from wafl.cli.report.table import LAST, Run, label

    from benchmarks._claim_pairs import runs_by_column

    runs, values = runs_by_column(records, columns)
    probes = [Run(Path("sweep"), dict(c), []) for c in sweep_configs]
    out: list[dict[str, Any]] = []
    for panel in panels:
        for value in values:
            here = [r for r in runs if columns is None or field(r.config, columns) == value]
            sub: dict[str, Any] = {"title": panel.title, "metric": panel.metric, "column": columns, "value": value}
            sub["rows"], sub["missing"] = [], []
            for row in panel.rows:
                chosen = select(here, row.where)
                tables = sorted({label(r.config, by) for r in chosen})
                if len(tables) > 1:
                    raise SystemExit(
                        f"real_data: claims panel {panel.title!r}: row {row.spec!r} picks {len(tables)} table rows "
                        f"({'; '.join(tables)}): add a FIELD=VALUE that tells them apart"
                    )
                if not chosen:
                    if not select(runs, row.where) and not select(probes, row.where):
                        raise SystemExit(
                            f"real_data: claims panel {panel.title!r}: row {row.spec!r} matches no point of the sweep"
                        )
                    sub["missing"].append(row.name)
                    continue
                (curve,) = curves(chosen, by, [panel.metric]).values()
                c = curve[panel.metric]
                if not c["round"]:
                    raise SystemExit(
                        f"real_data: claims panel {panel.title!r}: row {row.spec!r} has no {panel.metric} values"
                    )
                lasts = [
                    t
                    for r in chosen
                    if (
                        t := [(int(x["round"]), float(x[panel.metric])) for x in r.rows if _finite(x.get(panel.metric))]
                    )
                ]
                lasts = [t[-LAST:] for t in lasts]
                sub["rows"].append(
                    {
                        "name": row.name,
                        "spec": row.spec,
                        "table_row": tables[0],
                        "seeds": curve["seeds"],
                        "points": sorted(str(r.path) for r in chosen),
                        "round": c["round"],
                        "mean": [100.0 * v for v in c["mean"]],
                        "min": [100.0 * v for v in c["min"]],
                        "max": [100.0 * v for v in c["max"]],
                        "runs_per_round": c["runs_per_round"],
                        "stops": sorted((_stop(r, panel.metric) for r in chosen), key=lambda s: s["seed"]),
                        "mean_last": 100.0 * sum(sum(v for _, v in t) / len(t) for t in lasts) / len(lasts),
                        "last_rounds": [[t[0][0], t[-1][0]] for t in lasts],
                    }
                )
            windows = {tuple(w) for row_ in sub["rows"] for w in row_["last_rounds"]}
            sub["window"] = list(windows.pop()) if len(windows) == 1 else None
            out.append(sub)
    return out


def _finite(v: Any) -> bool:
    from wafl.cli.report.curves import _number

    return _number(v)


METRIC_NAMES = {
    "gm_accuracy": "GM accuracy (%)",
    "pm_accuracy": "PM accuracy (%)",
    "local_accuracy": "local accuracy (%)",
    "new_client_accuracy": "new-client accuracy (%)",
}


def plot_claims(
    subplots: Sequence[Mapping[str, Any]], columns: str | None, path: Path, title: str
) -> list[dict[str, Any]]:
    """One panel per claim family (with ``columns``, a row of them per family, a column per value): each
    row's mean over its seeds with the min-max band, the first row (the claim's subject) in black; the
    plateau marked per seed (a dotted line and a triangle at the round a seed stopped on it; a cross at the
    last round of a seed that reached the maximum without flattening) and, where all the runs of a panel end
    on the same rounds, those last 10 evaluated rounds shaded (their mean is the table's final accuracy).
    Returns what each panel shows, read back from its drawing (:func:`_drawn`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    ncol = len({json.dumps(s["value"]) for s in subplots}) if columns else _grid_columns(len(subplots))
    nrow = -(-len(subplots) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(4.6 * ncol, 9.0), 3.7 * nrow + 0.7), squeeze=False)
    seen = {"plateau": False, "max_rounds": False, "window": False, "no_rule": False}
    for ax, sub in zip(axes.flat, subplots):
        if sub["window"]:
            ax.axvspan(sub["window"][0] - 0.5, sub["window"][1] + 0.5, color="0.85", alpha=0.6, lw=0, zorder=0)
            seen["window"] = True
        for i, row in enumerate(sub["rows"]):
            color = "black" if i == 0 else f"C{(i - 1) % 10}"
            stops = row["stops"]
            plateau = [s for s in stops if s["stop_reason"] == "plateau"]
            maxed = [s for s in stops if s["stop_reason"] == "max_rounds"]
            seen["no_rule"] |= any(s["stop_reason"] is None for s in stops)
            how = f"{len(stops)} seed{'s' if len(stops) > 1 else ''}"
            if plateau or maxed:
                how += f"; flat {len(plateau)}, max {len(maxed)}"
            text = f"{row['name']}: {row['mean_last']:.1f} ({how})"
            ax.plot(row["round"], row["mean"], color=color, lw=2.0 if i == 0 else 1.2, label=text)
            if any(n > 1 for n in row["runs_per_round"]):
                ax.fill_between(row["round"], row["min"], row["max"], color=color, alpha=0.12, lw=0)
            for s in plateau:
                ax.axvline(s["round"], color=color, ls=":", lw=1.0, alpha=0.8)
                if s["value"] is not None:
                    ax.plot([s["value_round"]], [s["value"]], marker="v", ms=7, color=color, mec="white", mew=0.5)
                seen["plateau"] = True
            for s in maxed:
                if s["value"] is not None:
                    ax.plot([s["value_round"]], [s["value"]], marker="x", ms=7, mew=1.5, color=color)
                seen["max_rounds"] = True
        head = sub["title"] if not columns else f"{sub['title']}, {columns}={sub['value']}"
        if sub["missing"]:
            head += f"\n(not yet run: {', '.join(sub['missing'])})"
        ax.set_title(head, fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel(METRIC_NAMES.get(sub["metric"], sub["metric"]))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if sub["rows"]:
            ax.legend(fontsize=7, loc="best", frameon=True, framealpha=0.8)
    for ax in list(axes.flat)[len(subplots) :]:
        ax.set_visible(False)
    drawn = [_drawn(ax) for ax in list(axes.flat)[: len(subplots)]]
    final = "after a name: the table's final accuracy (the mean of each seed's last 10 evaluated rounds)"
    keys: list[Any] = [Line2D([], [], ls="", label=final)]
    if seen["window"]:
        keys.append(Patch(color="0.85", label="the last 10 evaluated rounds"))
    if seen["plateau"]:
        keys.append(
            Line2D(
                [],
                [],
                color="0.3",
                ls=":",
                marker="v",
                label="a seed stopped on the plateau (round); the mean goes on over the others",
            )
        )
    if seen["max_rounds"]:
        keys.append(Line2D([], [], color="0.3", ls="", marker="x", label="a seed reached the maximum, not flat"))
    if seen["no_rule"]:
        keys.append(Line2D([], [], ls="", label="no plateau rule: a fixed number of rounds, curves may still climb"))
    fig.legend(handles=keys, loc="lower center", ncol=2, fontsize=7.5, frameon=False, handlelength=1.5)
    fig.suptitle(title, fontsize=10)
    height = 3.7 * nrow + 0.7
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1 - 0.25 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def _drawn(ax: Any) -> dict[str, Any]:
    """A panel's contents as drawn: its title, its curves' legend texts, the plateau triangles and the
    maximum's crosses (round, value), the dotted lines' rounds and the shaded window (None without one)."""

    def at(marker: str) -> list[list[float]]:
        return [[float(x), float(y)] for ln in ax.lines if ln.get_marker() == marker for x, y in ln.get_xydata()]

    dotted = [float(ln.get_xdata()[0]) for ln in ax.lines if ln.get_linestyle() == ":"]
    spans = [p.get_bbox() for p in ax.patches]  # axvspan's rectangle (x in rounds)
    legend = ax.get_legend()
    return {
        "title": ax.get_title(),
        "curves": [t.get_text() for t in legend.get_texts()] if legend else [],
        "plateau": at("v"),
        "max_rounds": at("x"),
        "dotted": dotted,
        "shaded": [float(spans[0].x0), float(spans[0].x1)] if spans else None,
    }


def _grid_columns(n: int) -> int:
    """Columns of a grid of ``n`` panels: a row up to 3, 2 x 2 for 4, then 3 or 4 wide."""
    return n if n <= 3 else 2 if n == 4 else min(4, -(-n // 2))


def claims_figure(sweep_file: Path, records: Mapping[str, Mapping[str, Any]], by: Sequence[str], here: Path) -> bool:
    """``claims.png`` and ``claims.json`` in ``here`` from the finished ``records`` when the sweep file's header
    declares claims panels; returns whether it did."""
    panels, columns = claim_panels(sweep_file)
    if not panels:
        return False
    configs = [c for _, c in load_sweep_configs(sweep_file)]
    subplots = claims_data(panels, columns, records, by, configs)
    title = f"{sweep_file.stem}: the claims' comparisons (mean over seeds, min-max band)"
    plot_claims(subplots, columns, here / CLAIMS_FIGURE, title)
    doc = {"sweep": _shown(sweep_file), "by": list(by), "columns": columns, "unit": "%", "panels": subplots}
    (here / CLAIMS_JSON).write_text(json.dumps(doc, indent=1) + "\n")
    return True


CLAIM_PAIRS_JSON = "claims-pairs.json"


def claims_pairs_section(sweep_file: Path, records: Mapping[str, Mapping[str, Any]], here: Path) -> list[str]:
    """``claims-pairs.json`` in ``here`` and table.md's section on it (``benchmarks/_claim_pairs.py``) when the
    header declares claims panels: each panel's pairs over the finished ``records`` and, for a sweep that
    ``extends`` a table with kept records (a plateau table), the same pairs of that table beside them."""
    from benchmarks._claim_pairs import claim_pairs, markdown, moved

    def compared(sweep: Path) -> tuple[list[ClaimPanel], str | None]:  # the drawn panels, then the pairs only
        panels, columns = claim_panels(sweep)
        return panels + claim_panels(sweep, "claims pair")[0], columns

    panels, columns = compared(sweep_file)
    if not panels:
        return []
    doc: dict[str, Any] = {"sweep": _shown(sweep_file), "columns": columns, "unit": "points", "before": None}
    parent = tomllib.loads(sweep_file.read_text()).get("extends")
    parent_file = sweep_file.parent / parent if isinstance(parent, str) else None
    kept: dict[str, Any] = {}
    if parent_file is not None and records_file(parent_file).is_file():
        kept = {n: r for n, r in read_records(records_file(parent_file)).items() if not incomplete(r)}
    rounds = sorted({int(r["config"]["rounds"]) for r in kept.values()})
    # the plateau runs read at the shorter table's last round too, where it has one; and, where the runs stop on
    # the plateau at rounds of their own, each pair at the earlier of its two runs' last rounds
    plateau = any(r["config"].get("plateau_window") for r in records.values())
    pairs = claim_pairs(panels, columns, records, rounds[0] if len(rounds) == 1 else None, equal_rounds=plateau)
    before_name = before_rounds = None
    if kept and parent_file is not None:
        pairs = moved(pairs, claim_pairs(*compared(parent_file), kept))
        before_name = parent_file.stem
        before_rounds = "round " + ", ".join(map(str, rounds))
        doc["before"] = {
            "sweep": _shown(parent_file),
            "records": _shown(records_file(parent_file)),
            "rounds": rounds,
        }
    doc["pairs"] = pairs
    (here / CLAIM_PAIRS_JSON).write_text(json.dumps(doc, indent=1) + "\n")
    return markdown(pairs, before_name, before_rounds)


SMOKE_SWEEP = """\
# a two-point digits sweep for the smoke run: each point stops on the plateau after round 2 of at most 3
#   wafl table runs/sweep-smoke --baseline fedavg   # a trailing comment is not an argument
#   wafl analyze curves runs/sweep-smoke --metrics train_loss \\
#       --out runs/sweep-smoke/loss.png --json runs/sweep-smoke/loss.json
#   claims panel "GM: FedProx against FedAvg" gm_accuracy FedProx:fedprox FedAvg:fedavg
out = "runs/sweep-smoke"
[base]
num_clients = 3
rounds = 3
plateau_window = 1
plateau_delta = 100.0
protocol = "compute-and-wait"
round_deadline_s = 3600.0
checkpoint = false
[grid]
algorithm = ["fedavg", "fedprox"]
"""


def smoke(out: Path) -> dict[str, object]:
    """The whole cycle on a tiny digits sweep in ``out``: run, keep, restore into a fresh folder (where the
    sweep then has nothing left to run), and the summary; returns (and writes to smoke.json) what it saw."""
    from wafl.cli.report.provenance import git_commit

    out.mkdir(parents=True, exist_ok=True)
    sweep_file = out / "smoke.toml"
    sweep_file.write_text(SMOKE_SWEEP)
    kept = out / "kept" / "records.json"
    first = subprocess.run([WAFL, "sweep", str(sweep_file), "--out", str(out / "a")], capture_output=True, text=True)
    saved = save(sweep_file, out / "a", kept)
    restored = restore(kept, out / "b")
    again = subprocess.run([WAFL, "sweep", str(sweep_file), "--out", str(out / "b")], capture_output=True, text=True)
    same = {
        f"{n}/{f}": (out / "a" / n / f).read_bytes() == (out / "b" / n / f).read_bytes()
        for n in points(sweep_file)
        for f in RECORD
    }
    broken = out / "kept" / "broken.json"  # one record without its rows: named, not restored
    recs = read_records(kept)
    first_point = sorted(recs)[0]
    recs[first_point] = {**recs[first_point], "rows": []}
    write_records(broken, recs)
    partly = restore(broken, out / "c")
    here = summary(sweep_file, kept, out / "work")
    verified = verify(sweep_file, kept, ["algorithm=fedavg*"], out / "verify")
    tampered = out / "kept" / "tampered.json"  # a kept accuracy changed in its last digit: verify names it
    recs = read_records(kept)
    recs[first_point]["rows"][-1]["gm_accuracy"] += 1e-4
    write_records(tampered, recs)
    caught = verify(sweep_file, tampered, [first_point], out / "verify-tampered")
    # its first round only (run to round 2, the rule's two windows): the tampered last round is not compared
    first_only = verify(sweep_file, tampered, [first_point], out / "verify-first", first=1)
    first_rows = (out / "verify-first" / first_point / "results.jsonl").read_text().splitlines()
    doc: dict[str, object] = {
        "commit": git_commit(),
        "first_rc": first.returncode,
        "kept": saved,
        "restored": restored,
        "second_run": again.stderr.strip().splitlines()[0] if again.stderr.strip() else "",
        "second_rc": again.returncode,
        "kept_points": {n: sorted(r) for n, r in read_records(kept).items()},
        "round_trip_same_bytes": same,
        "verified": verified,
        "tampered_caught": caught,
        "first_round_verified": first_only,
        "first_round_run_rows": len(first_rows),
        "broken_restored": partly,
        "broken_point_left_out": not (out / "c" / first_point).exists(),
        "table_md": (here / "table.md").read_text(),
        "table": json.loads((here / "table.json").read_text()),
        "curves_png_bytes": (here / "curves.png").stat().st_size,
        "figure": json.loads((here / "loss.json").read_text()),
        "claims": json.loads((here / CLAIMS_JSON).read_text()),
        "claims_png_bytes": (here / CLAIMS_FIGURE).stat().st_size,
        "claims_pairs": json.loads((here / CLAIM_PAIRS_JSON).read_text()),
    }
    (out / "smoke.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="benchmarks/real_data.py")
    p.add_argument("action", nargs="?", choices=["run", "restore", "save", "summary", "verify"])
    p.add_argument("sweep_file", nargs="?", type=Path)
    p.add_argument("--smoke", action="store_true", help="the whole cycle on a tiny digits sweep in --out")
    p.add_argument("--out", type=Path, help="the sweep's output folder (run, restore, save)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--first",
        action="append",
        default=[],
        metavar="GLOB",
        help="with run: points whose names match this pattern run before the others (repeatable; wafl sweep --first)",
    )
    p.add_argument(
        "--records",
        type=Path,
        help="the kept records' file (default: benchmarks/results/real-data/<sweep>/records.json)",
    )
    p.add_argument(
        "--rerun",
        action="append",
        default=[],
        metavar="GLOB",
        help="with run: run these points again (names as in records.json, fnmatch patterns such as "
        "'algorithm=pfedme,*'; repeatable): their kept records and finished folders are dropped first",
    )
    p.add_argument(
        "--point",
        action="append",
        default=[],
        metavar="GLOB",
        help="with verify: the kept points to run again and compare (fnmatch patterns of their names; repeatable)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="with verify: run and compare each point's first N rounds only (a few more are run: the evaluations "
        "of the compared rounds are the point's own)",
    )
    a = p.parse_args(argv)
    if a.rounds is not None and (a.action != "verify" or a.rounds < 1):
        p.error("--rounds N goes with verify, N at least 1")
    if a.rerun and a.action != "run":
        p.error("--rerun goes with the action run")
    if a.first and a.action != "run":
        p.error("--first goes with the action run")
    if bool(a.point) != (a.action == "verify"):
        p.error("verify needs --point GLOB, and --point goes with verify only")
    if a.smoke:
        if a.out is None:
            p.error("--smoke needs --out, a folder for its sweep")
        smoke(a.out.resolve())
        return 0
    if a.action is None or a.sweep_file is None:
        p.error("give an action (run, restore, save, summary, verify) and a sweep file, or --smoke")
    sweep_file = a.sweep_file.resolve()
    kept = (a.records or records_file(sweep_file)).resolve()
    if not sweep_file.is_file():
        p.error(f"sweep file {a.sweep_file} does not exist")
    if a.action == "verify":
        import tempfile

        with tempfile.TemporaryDirectory(prefix="real-data-verify-") as tmp:
            found = verify(sweep_file, kept, a.point, a.out or Path(tmp), a.rounds)
        same = [n for n, d in found.items() if not d]
        print(f"real_data: {len(same)} of {len(found)} point(s) gave the kept numbers", file=sys.stderr)
        return 0 if len(same) == len(found) else 1
    if a.action not in ("summary", "verify") and a.out is None:
        p.error(f"{a.action} needs --out, the sweep's output folder")
    if a.rerun:
        dropped = drop(sweep_file, a.out, kept, a.rerun)
        print(f"real_data: {len(dropped)} point(s) to run again: {', '.join(dropped)}", file=sys.stderr)
    if a.action in ("run", "restore"):
        print(f"real_data: {restore(kept, a.out, sweep_file)} kept point(s) restored into {a.out}", file=sys.stderr)
    if a.action == "run":
        first = [arg for pattern in a.first for arg in ("--first", pattern)]
        rc = subprocess.call(
            [WAFL, "sweep", str(sweep_file), "--jobs", str(a.jobs), "--out", str(a.out), *first], cwd=ROOT
        )
        print(f"real_data: {save(sweep_file, a.out, kept)} finished point(s) kept in {kept}", file=sys.stderr)
        return rc
    if a.action == "save":
        print(f"real_data: {save(sweep_file, a.out, kept)} finished point(s) kept in {kept}", file=sys.stderr)
    if a.action == "summary":
        print(f"real_data: summary in {summary(sweep_file, kept)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

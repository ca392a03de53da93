"""The Fashion-MNIST tables (configs/sweeps/*_fmnist*.toml): run a sweep across several sittings, keep
the record of every finished point in the repository, and make the table and the curves from those
records.

A table's sweep takes hours, longer than a machine may stay up. Each finished point's record (its
``config.json``, ``results.jsonl``: one row of metrics a round, and ``point.json``: the commit and the
point's wall-clock) is small, a few kB, and is all that ``wafl table`` and ``wafl analyze curves``
read; the per-process logs and reports are not kept. ``save`` copies the records of the finished
points into ``benchmarks/results/real-data/<sweep>/runs/``; ``run`` first copies the kept records into
the sweep's output folder, so ``wafl sweep`` skips those points and runs only the rest, then saves.

    python benchmarks/real_data.py run configs/sweeps/scd_fmnist.toml --out /tmp/sweeps/scd_fmnist --jobs 2
    python benchmarks/real_data.py save configs/sweeps/scd_fmnist.toml --out /tmp/sweeps/scd_fmnist
    python benchmarks/real_data.py summary configs/sweeps/scd_fmnist.toml

``summary`` writes ``table.md`` (the command, the commits, the points done and missing, then
``wafl table``'s markdown), ``table.json`` and ``curves.png`` / ``curves.json`` (accuracy against
rounds, mean and min-max over the seeds) next to the records. The table's ``--by`` and
``--baseline`` are the ones the sweep file's header gives (its ``#   wafl table ...`` line); while
the baseline's points are not all done the paired differences are left out and the text says so.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "real-data"
RECORD = ("config.json", "results.jsonl", "point.json")


def records_dir(sweep_file: Path) -> Path:
    """Where a sweep's kept records live by default: benchmarks/results/real-data/<sweep>/runs."""
    return RESULTS / sweep_file.stem / "runs"


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (as the committed texts name it)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def table_args(sweep_file: Path) -> list[str]:
    """The ``wafl table`` options after the folder on the sweep file's ``#   wafl table DIR ...`` line."""
    for line in sweep_file.read_text().splitlines():
        text = line.lstrip("#").strip()
        if line.startswith("#") and text.startswith("wafl table "):
            return shlex.split(text)[3:]
    return []


def points(sweep_file: Path) -> list[str]:
    from wafl.cli.sweep import load_sweep

    return [name for name, _ in load_sweep(sweep_file)[1]]


def restore(kept: Path, out: Path) -> int:
    """Copies the kept records into ``out`` (points already there are left as they are). A kept point that
    lacks one of its files is named on stderr and not restored, so the sweep runs it again."""
    n = 0
    for src in sorted(kept.glob("*/point.json")) if kept.is_dir() else []:
        dst = out / src.parent.name
        if (dst / "point.json").exists():
            continue
        missing = [f for f in RECORD if not (src.parent / f).is_file()]
        if missing:
            lacks = ", ".join(missing)
            print(f"real_data: {_shown(src.parent)} lacks {lacks}: not restored, it runs again", file=sys.stderr)
            continue
        dst.mkdir(parents=True, exist_ok=True)
        for f in RECORD:
            shutil.copy2(src.parent / f, dst / f)
        n += 1
    return n


def save(sweep_file: Path, out: Path, kept: Path) -> int:
    """Copies the record of every finished point of ``out`` into ``kept``."""
    n = 0
    for name in points(sweep_file):
        src = out / name
        if not (src / "point.json").exists():
            continue
        missing = [f for f in RECORD if not (src / f).is_file()]
        if missing:
            raise SystemExit(f"real_data: {src} is marked finished but lacks {', '.join(missing)}")
        dst = kept / name
        dst.mkdir(parents=True, exist_ok=True)
        for f in RECORD:
            shutil.copy2(src / f, dst / f)
        n += 1
    return n


WAFL = str(Path(sys.executable).parent / "wafl")  # the command of the environment this runs in


def _wafl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WAFL, *args], capture_output=True, text=True, cwd=ROOT)


def summary(sweep_file: Path, kept: Path) -> Path:
    """table.md, table.json, curves.png and curves.json beside the kept records (in ``kept``'s parent)."""
    names = points(sweep_file)
    done = [n for n in names if (kept / n / "point.json").exists()]
    if not done:
        raise SystemExit(f"real_data: no finished points of {sweep_file} in {kept}")
    here = kept.parent
    rel = _shown(kept)
    args = table_args(sweep_file)
    note = ""
    if "--baseline" in args:
        i = args.index("--baseline")
        trial = _wafl("table", str(rel), *args)
        if trial.returncode != 0 and "is not a row" in trial.stderr:
            note = f"The baseline {args[i + 1]!r} has no finished point yet: no paired differences.\n\n"
            args = args[:i] + args[i + 2 :]
    res = _wafl("table", str(rel), *args, "--json", _shown(here / "table.json"))
    if res.returncode != 0:
        raise SystemExit(f"real_data: wafl table failed: {res.stderr.strip()}")
    commits = json.loads((here / "table.json").read_text())["commits"]
    missing = [n for n in names if n not in done]
    by = args[args.index("--by") + 1] if "--by" in args else "algorithm,params"
    rows = [json.loads(line) for d in done for line in (kept / d / "results.jsonl").read_text().splitlines() if line]
    fields = ("gm_accuracy", "pm_accuracy", "local_accuracy", "new_client_accuracy")
    metrics = ",".join(f for f in fields if any(r.get(f) is not None for r in rows))
    curves = _wafl(
        "analyze", "curves", str(rel), "--by", by, "--metrics", metrics,
        "--title", f"{sweep_file.stem}: accuracy against rounds (mean, min-max over seeds)",
        "--out", _shown(here / "curves.png"), "--json", _shown(here / "curves.json"),
    )  # fmt: skip
    if curves.returncode != 0:
        raise SystemExit(f"real_data: wafl analyze curves failed: {curves.stderr.strip()}")
    text = [
        f"`wafl table {rel} {shlex.join(args)}` (the runs: `wafl sweep {_shown(sweep_file)} --jobs 2`, "
        f"in process, at commit{'s' if len(commits) > 1 else ''} {', '.join(c[:7] for c in commits)}).",
        "",
        f"Points done: {len(done)} of {len(names)}."
        + (f" Not yet run: {', '.join(f'`{m}`' for m in missing)}." if missing else ""),
        "",
        note + res.stdout.strip(),
        "",
    ]
    (here / "table.md").write_text("\n".join(text))
    return here


SMOKE_SWEEP = """\
# a two-point digits sweep for the smoke run
#   wafl table runs/sweep-smoke --baseline fedavg
out = "runs/sweep-smoke"
[base]
num_clients = 3
rounds = 2
protocol = "compute-and-wait"
round_deadline_s = 3600.0
checkpoint = false
[grid]
algorithm = ["fedavg", "fedprox"]
"""


def smoke(out: Path) -> dict[str, object]:
    """The whole cycle on a tiny digits sweep in ``out``: run, keep, restore into a fresh folder (where the
    sweep then has nothing left to run), and the summary; returns (and writes to smoke.json) what it saw."""
    from wafl.cli.provenance import git_commit

    out.mkdir(parents=True, exist_ok=True)
    sweep_file = out / "smoke.toml"
    sweep_file.write_text(SMOKE_SWEEP)
    kept = out / "kept" / "runs"
    first = subprocess.run([WAFL, "sweep", str(sweep_file), "--out", str(out / "a")], capture_output=True, text=True)
    saved = save(sweep_file, out / "a", kept)
    restored = restore(kept, out / "b")
    again = subprocess.run([WAFL, "sweep", str(sweep_file), "--out", str(out / "b")], capture_output=True, text=True)
    here = summary(sweep_file, kept)
    doc: dict[str, object] = {
        "commit": git_commit(),
        "first_rc": first.returncode,
        "kept": saved,
        "restored": restored,
        "second_run": again.stderr.strip().splitlines()[0] if again.stderr.strip() else "",
        "second_rc": again.returncode,
        "kept_files": sorted(str(f.relative_to(kept)) for f in kept.rglob("*") if f.is_file()),
        "table_md": (here / "table.md").read_text(),
        "table": json.loads((here / "table.json").read_text()),
        "curves_png_bytes": (here / "curves.png").stat().st_size,
    }
    (out / "smoke.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="benchmarks/real_data.py")
    p.add_argument("action", nargs="?", choices=["run", "restore", "save", "summary"])
    p.add_argument("sweep_file", nargs="?", type=Path)
    p.add_argument("--smoke", action="store_true", help="the whole cycle on a tiny digits sweep in --out")
    p.add_argument("--out", type=Path, help="the sweep's output folder (run, restore, save)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--records", type=Path, help="where the kept records are (default: benchmarks/results/real-data/<sweep>/runs)"
    )
    a = p.parse_args(argv)
    if a.smoke:
        if a.out is None:
            p.error("--smoke needs --out, a folder for its sweep")
        smoke(a.out.resolve())
        return 0
    if a.action is None or a.sweep_file is None:
        p.error("give an action (run, restore, save, summary) and a sweep file, or --smoke")
    sweep_file = a.sweep_file.resolve()
    kept = (a.records or records_dir(sweep_file)).resolve()
    if not sweep_file.is_file():
        p.error(f"sweep file {a.sweep_file} does not exist")
    if a.action != "summary" and a.out is None:
        p.error(f"{a.action} needs --out, the sweep's output folder")
    if a.action in ("run", "restore"):
        print(f"real_data: {restore(kept, a.out)} kept point(s) restored into {a.out}", file=sys.stderr)
    if a.action == "run":
        rc = subprocess.call([WAFL, "sweep", str(sweep_file), "--jobs", str(a.jobs), "--out", str(a.out)], cwd=ROOT)
        print(f"real_data: {save(sweep_file, a.out, kept)} finished point(s) kept in {kept}", file=sys.stderr)
        return rc
    if a.action == "save":
        print(f"real_data: {save(sweep_file, a.out, kept)} finished point(s) kept in {kept}", file=sys.stderr)
    if a.action == "summary":
        print(f"real_data: summary in {summary(sweep_file, kept)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared code of the digits learning checks (``scd_digits``, ``fedhkd_digits``, ``asd_digits``).

Each check builds a few :class:`~wafl.common.config.RunConfig` objects from one shared base,
runs them for several seeds with :func:`wafl.cli.simulate.run_many` (the real client trainer,
the server's accumulator and server updates, in one process, on the CPU, one thread), and
writes ``benchmarks/results/<name>.json`` (configurations, per-seed finals and curves,
mean/std/min/max, machine, wall time) and ``<name>.md`` (a table the README includes as is).

Accuracies in the tables are percentages: mean +- population std over the seeds, then the
spread (min-max) in parentheses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _machine import cpu_name
from wafl.cli.bench import git_commit
from wafl.cli.simulate import run_many, summarize
from wafl.common.config import RunConfig, load_config

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"

METRICS = ("gm_accuracy", "pm_accuracy")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(
    name: str, description: str, default_rounds: int, add: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    """``--seeds`` (default 0 1 2), ``--rounds``, ``--out`` (default ``benchmarks/results/<name>.json``), plus
    ``add``'s."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="seeds; each changes the split, the initial model and the batches",
    )
    p.add_argument("--rounds", type=int, default=default_rounds, help="federated rounds of every run")
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR / f"{name}.json",
        help="result JSON; the markdown table goes next to it (.md)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the runs of an existing --out whose configuration and seeds match exactly",
    )
    if add is not None:
        add(p)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def make_config(base: Mapping[str, Any], **overrides: Any) -> RunConfig:
    """``base`` updated with ``overrides`` (``params`` merged key by key), validated."""
    data = dict(base)
    params = {**dict(base.get("params", {})), **dict(overrides.pop("params", {}) or {})}
    data.update(overrides)
    data["params"] = params
    return load_config(None, data)


def describe(
    cfg: RunConfig, keys: Iterable[str] = ("algorithm", "params", "optimizer", "lr", "momentum")
) -> dict[str, Any]:
    d = json.loads(cfg.to_json())
    return {k: d[k] for k in keys}


def config_key(config: Mapping[str, Any] | RunConfig, seeds: Iterable[int]) -> str:
    """Identifies a run set by its full configuration and seeds (to reuse it with ``--resume``)."""
    d = json.loads(config.to_json()) if isinstance(config, RunConfig) else dict(config)
    return json.dumps(d, sort_keys=True) + "|" + json.dumps(list(seeds))


def previous_runs(path: Path) -> dict[str, Any]:
    """Every run set (an entry with ``config`` and ``runs``) found anywhere in an earlier result JSON."""
    found: dict[str, Any] = {}
    if not path.is_file():
        return found
    data = json.loads(path.read_text())

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            if isinstance(o.get("config"), dict) and isinstance(o.get("runs"), list):
                found[config_key(o["config"], [r["seed"] for r in o["runs"]])] = {
                    "reused_from": data.get("started"),
                    **o,
                }
                return
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(data)
    return found


def run_suite(
    configs: Mapping[str, RunConfig], seeds: list[int], tag: str = "", reuse: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Runs each configuration for each seed (one thread); adds ``wall_s`` per configuration.

    The result maps each name to ``run_many``'s entry: ``config`` (JSON), ``runs`` (per seed:
    final ``gm_accuracy``/``pm_accuracy``, ``wall_s``, ``curve`` = per-round ``(gm, pm)``) and
    ``gm_accuracy``/``pm_accuracy`` summaries (mean, std, min, max). A configuration whose exact
    configuration and seeds are in ``reuse`` (see :func:`previous_runs`) is taken from there.
    """
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    total = len(configs)
    for i, (name, cfg) in enumerate(configs.items(), 1):
        key = config_key(cfg, seeds)
        if reuse is not None and key in reuse:
            out[name] = dict(reuse[key])
            log(f"{tag}[{i}/{total}] {name}: reused from {out[name].get('reused_from')}")
            continue
        log(
            f"{tag}[{i}/{total}] {name}: {cfg.algorithm} {json.dumps(cfg.params, sort_keys=True)} "
            f"{cfg.optimizer} lr {cfg.lr} mom {cfg.momentum}, {cfg.rounds} rounds, seeds {seeds}"
        )
        t0 = time.monotonic()
        res = run_many({name: cfg}, seeds, log=lambda m: log(f"{tag}  {m}"))[name]
        res["config"] = json.loads(res["config"])
        res["wall_s"] = time.monotonic() - t0
        out[name] = res
    return out


def best(results: Mapping[str, Any], names: Iterable[str], metric: str) -> str:
    """The name among ``names`` with the highest mean ``metric`` (first one on ties)."""
    names = list(names)
    return max(names, key=lambda n: (results[n][metric]["mean"], -names.index(n)))


def pct(summary: Mapping[str, float] | None, spread: bool = True) -> str:
    if not summary:
        return "—"
    s = f"{100 * summary['mean']:.1f} ± {100 * summary['std']:.1f}"
    if spread:
        s += f" ({100 * summary['min']:.1f}–{100 * summary['max']:.1f})"
    return s


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def accuracy_table(
    results: Mapping[str, Any],
    rows: list[tuple[str, str]],
    metrics: Iterable[str] = METRICS,
    extra: Mapping[str, Callable[[Mapping[str, Any]], str]] | None = None,
) -> str:
    """One row per ``(label, result name)``: final accuracy (%) as mean ± std (min–max) over seeds."""
    titles = {"gm_accuracy": "GM accuracy (%)", "pm_accuracy": "PM accuracy (%)"}
    metrics = list(metrics)
    header = ["Method", *[titles[m] for m in metrics], *(extra or {})]
    body = []
    for label, name in rows:
        r = results[name]
        body.append([label, *[pct(r.get(m)) for m in metrics], *[f(r) for f in (extra or {}).values()]])
    return markdown_table(header, body)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpu_model": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "nice": os.nice(0),
        "device": "cpu",
    }
    try:
        info["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    return info


class Report:
    """Collects what a check measured and writes the JSON and the markdown next to it."""

    def __init__(self, name: str, args: argparse.Namespace, description: str) -> None:
        torch.set_num_threads(1)
        self.name = name
        self.out: Path = args.out
        self.t0 = time.monotonic()
        self.reuse = previous_runs(self.out) if getattr(args, "resume", False) else None
        self.data: dict[str, Any] = {
            "benchmark": name,
            "commit": git_commit(),
            "description": description,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seeds": list(args.seeds),
            "rounds": args.rounds,
            "machine": machine_info(),
        }
        if self.reuse is not None:
            self.data["resumed_from"] = str(self.out)

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def write(self, markdown: str) -> None:
        self.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.data["wall_s"] = time.monotonic() - self.t0
        try:
            self.data["machine"]["loadavg_end"] = list(os.getloadavg())
        except OSError:
            pass
        self.data["compute_s"] = _compute_s(self.data)
        self.data["table_md"] = markdown
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable) + "\n")
        os.replace(tmp, self.out)
        md = self.out.with_suffix(".md")
        md.write_text(markdown.rstrip() + "\n")
        log(f"wrote {_rel(self.out)} and {_rel(md)} ({self.data['wall_s']:.0f} s)")
        print(markdown, flush=True)


def _compute_s(o: Any) -> float:
    """Sum of ``wall_s`` over every run set in ``o`` (including runs reused with ``--resume``)."""
    if isinstance(o, dict):
        if isinstance(o.get("runs"), list) and "wall_s" in o:
            return float(o["wall_s"])
        return sum(_compute_s(v) for v in o.values())
    if isinstance(o, list):
        return sum(_compute_s(v) for v in o)
    return 0.0


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def _jsonable(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


__all__ = [
    "REPO",
    "RESULTS_DIR",
    "Report",
    "accuracy_table",
    "best",
    "config_key",
    "describe",
    "log",
    "make_config",
    "markdown_table",
    "parse_args",
    "pct",
    "previous_runs",
    "run_suite",
    "summarize",
]

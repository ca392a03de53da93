#!/usr/bin/env python
"""Training throughput on this machine's CPU: samples/s of one GM step and of one PM step per model.

Run from the repository root::

    python benchmarks/train_step.py     # writes benchmarks/results/train_step.json and .md

For each model (``cnn`` on 1x8x8 digits-shaped input; ``resnet18``, ``resnet34``, ``resnet50``,
``shufflenetv2`` on 3x32x32 CIFAR-shaped input; 10 classes, ``code_len`` 32), batch size 32,
``torch.set_num_threads(2)``, SGD (lr 0.01, momentum 0.9), random inputs held in memory (no data
loading), three kinds of step, each through the shared trainer ``wafl.common.training.run_phase``
with the algorithm's own loss terms:

* ``gm``: a FedAvg GM step, plain cross-entropy;
* ``pm_scd``: an SCD PM step, cross-entropy + ``lambda_p * D(s(w_p) || s(w_G))``: a DFT of the
  whole flattened weight vector and its gradient every step (the expensive term);
* ``pm_ditto``: a Ditto PM step, cross-entropy + ``(mu/2) ||v - w_g||^2``.

Each kind runs ``--warmup`` untimed steps, then timed steps until at least ``--min-steps`` and
``--min-time`` seconds (at most ``--max-steps``); a step is the time between two consecutive
batches of ``run_phase`` (forward, loss terms, backward, optimizer step, loss read back).
samples/s = batch size / median step time. Other processes on the same cores slow every step
down, so the machine's load average and the CPU utilization of each measurement (process CPU
time / (wall time x threads), about 1 on an otherwise idle machine) are recorded with the
figures, and the table says when a measurement did not get its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from itertools import cycle
from pathlib import Path
from typing import Any

import torch
from _machine import cpu_name
from wafl.cli.report.provenance import git_commit
from wafl.common.algorithms import registry
from wafl.common.algorithms.base import RoundContext
from wafl.common.models import build_model
from wafl.common.training import make_optimizer, run_phase

RESULTS = Path(__file__).resolve().parent / "results"
# model -> (in_channels, image_size): cnn on the embedded digits' shape, the rest on CIFAR's
MODELS = {
    "cnn": (1, 8),
    "resnet18": (3, 32),
    "resnet34": (3, 32),
    "resnet50": (3, 32),
    "shufflenetv2": (3, 32),
}
KINDS = {
    # kind -> (algorithm, which terms, description)
    "gm": ("fedavg", "gm", "GM step, FedAvg cross-entropy"),
    "pm_scd": ("scd", "pm", "PM step, SCD spectral term (full-model DFT)"),
    "pm_ditto": ("ditto", "pm", "PM step, Ditto proximal term"),
}
NUM_CLASSES = 10


def measure(
    name: str, kind: str, batch: int, warmup: int, min_steps: int, max_steps: int, min_time: float, seed: int = 0
) -> dict[str, Any]:
    channels, size = MODELS[name]
    algo_name, which, _ = KINDS[kind]
    algo = registry.resolve(algo_name)
    terms = algo.gm_terms if which == "gm" else algo.pm_terms
    assert terms is not None
    torch.manual_seed(seed)
    gm = build_model(name, NUM_CLASSES, channels, size, 32)
    model = gm
    pm = None
    if which == "pm":
        pm = build_model(name, NUM_CLASSES, channels, size, 32)
        pm.load_state_dict(gm.state_dict())
        model = pm
    g = torch.Generator().manual_seed(seed)
    data = [
        (torch.randn(batch, channels, size, size, generator=g), torch.randint(0, NUM_CLASSES, (batch,), generator=g))
        for _ in range(4)
    ]
    label_freq = torch.full((NUM_CLASSES,), 1.0 / NUM_CLASSES)
    ctx = RoundContext(1, {k: v.detach().clone() for k, v in gm.state_dict().items()}, gm, pm, label_freq, {})
    opt = make_optimizer("sgd", model.parameters(), 0.01, 0.9, 0.0)
    marks: list[float] = []
    cpu_marks: list[float] = []

    def should_stop() -> bool:  # called before every batch: consecutive calls bracket one step
        marks.append(time.perf_counter())
        cpu_marks.append(time.process_time())
        timed = len(marks) - 1 - warmup
        if timed < 0:
            return False
        elapsed = marks[-1] - marks[warmup]
        return timed >= max_steps or (timed >= min_steps and elapsed >= min_time)

    t0 = time.perf_counter()
    stats = run_phase(model, terms, ctx, cycle(data), opt, should_stop)
    step_s = [b - a for a, b in zip(marks[warmup:-1], marks[warmup + 1 :])]
    med = statistics.median(step_s)
    cpu_s = [b - a for a, b in zip(cpu_marks[warmup:-1], cpu_marks[warmup + 1 :])]
    threads = torch.get_num_threads()
    # share of the requested cores this process actually got while stepping; well below 1 means
    # other processes competed for the CPUs and the figures understate the machine
    utilization = sum(cpu_s) / (sum(step_s) * threads)
    return {
        "model": name,
        "kind": kind,
        "terms": [t.name for t in terms],
        "batch_size": batch,
        "input": [channels, size, size],
        "params": sum(p.numel() for p in model.parameters()),
        "warmup_steps": warmup,
        "timed_steps": len(step_s),
        "step_ms": [s * 1e3 for s in step_s],
        "median_step_ms": med * 1e3,
        "samples_per_s": batch / med,
        "cpu_s_per_step": statistics.median(cpu_s),
        "cpu_utilization": utilization,
        "mean_loss": stats.mean_loss,
        "wall_s": time.perf_counter() - t0,
    }


def markdown(res: dict[str, Any]) -> str:
    rows = {}
    for r in res["results"]:
        rows.setdefault(r["model"], {})[r["kind"]] = r
    m = res["machine"]
    lines = [
        f"Training throughput on the CPU ({m['cpu']}, {res['threads']} threads, torch {m['torch']}), batch "
        f"{res['batch_size']}, samples/s (median step in ms); load average {m['loadavg_before'][0]:.1f} before "
        f"and {m['loadavg_after'][0]:.1f} after on {m['cpus']} CPUs. "
        "Written by `python benchmarks/train_step.py`.",
        "",
        "| model | input | parameters | GM step (FedAvg CE) | PM step, SCD spectral term | PM step, Ditto "
        "proximal term | CPU utilization |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    low = []
    for name, kinds in rows.items():
        any_r = next(iter(kinds.values()))
        shape = "x".join(map(str, any_r["input"]))
        cells = []
        for kind in KINDS:
            r = kinds.get(kind)
            cells.append("-" if r is None else f"{r['samples_per_s']:.1f} ({r['median_step_ms']:.0f} ms)")
        utils = [r["cpu_utilization"] for r in kinds.values()]
        low += [f"{name} {k}" for k, r in kinds.items() if r["cpu_utilization"] < 0.8]
        lines.append(
            f"| {name} | {shape} | {any_r['params'] / 1e6:.2f}M | "
            + " | ".join(cells)
            + f" | {min(utils):.2f}-{max(utils):.2f} |"
        )
    lines.append("")
    if low:
        lines.append(f"Contended (CPU utilization below 0.8, figures too low): {', '.join(low)}.")
    else:
        lines.append("Every measurement had its cores (CPU utilization >= 0.8).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="samples/s of GM and PM training steps per model on this CPU")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--min-steps", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--min-time", type=float, default=2.0, help="seconds of timed steps per kind (at least --min-steps)")
    p.add_argument("--out", default=str(RESULTS / "train_step.json"))
    p.add_argument("--smoke", action="store_true", help="the cnn, one or two steps per kind: checks the script")
    a = p.parse_args(argv)
    if a.smoke:
        a.models, a.warmup, a.min_steps, a.max_steps, a.min_time = ["cnn"], 0, 1, 2, 0.0
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    results = []
    for name in a.models:
        for kind in a.kinds:
            r = measure(name, kind, a.batch_size, a.warmup, a.min_steps, a.max_steps, a.min_time)
            results.append(r)
            print(
                f"{name:<13} {kind:<9} {r['samples_per_s']:9.1f} samples/s  (median {r['median_step_ms']:.1f} "
                f"ms over {r['timed_steps']} steps, CPU utilization {r['cpu_utilization']:.2f})",
                flush=True,
            )
    res = {
        "benchmark": "train_step",
        "commit": git_commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_name(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg()),
        },
        "threads": a.threads,
        "batch_size": a.batch_size,
        "num_classes": NUM_CLASSES,
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "params": {"scd": registry.resolve("scd").params, "ditto": registry.resolve("ditto").params},
        "kinds": {k: v[2] for k, v in KINDS.items()},
        "results": results,
        "wall_s": time.perf_counter() - t0,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    out.with_suffix(".md").write_text(md)
    print()
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

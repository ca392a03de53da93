#!/usr/bin/env python
"""GPU fleet: 100 logical clients training ResNet-18 on generated CIFAR-shaped data in workers on one GPU.

Run through ``bash benchmarks/gpu_fleet.sh`` on a machine with a GPU (it finds the virtual
environment and stops this script after 290 s), or directly::

    python benchmarks/gpu_fleet.py                          # 100 clients, 4 workers x 4 slots, cuda
    python benchmarks/gpu_fleet.py --device cpu --clients 4 --workers 2 --slots 1 --model cnn \\
        --dataset synthetic-cifar10 --rounds 2              # smoke check of the script itself

One real ``wafl run --workers`` (``wafl.cli.launch.launcher.launch``: a server process and worker
processes over localhost gRPC), FedAvg, wait-free, every client selected every round, on
``synthetic-cifar10-50k`` (generated data of CIFAR-10's shapes and sizes: 50,000 training and
10,000 test images). Measured: every round's time (the median over the rounds after the first is
the round time, the first includes the warm-up; rounds per hour = 3600 / round time), the GPU's
memory in use and utilization sampled with ``nvidia-smi`` every 0.5 s (peak memory; utilization's
mean over the rounds after the first), the workers' device residency (``resident_max``: the most
clients whose tensors were on the GPU at once; ``offloads`` / ``onloads``: the moves of idle
clients' tensors to host memory and back) and the final GM accuracy.

Exit 0 when the run finished its rounds, 1 when it did not, 2 when the device is not available
(no CUDA: nothing is measured). ``--json FILE`` writes everything measured (default
``benchmarks/results/gpu/gpu_fleet.json``, with ``gpu_fleet.md`` beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import Sampler, cpu_name, provenance

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--slots", type=int, default=4, help="trainings at once per worker")
    p.add_argument("--rounds", type=int, default=3, help="the first includes the warm-up")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--dataset", default="synthetic-cifar10-50k")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--timeout", type=float, default=270.0, help="seconds for the whole run")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "gpu" / "gpu_fleet.json"))
    p.add_argument(
        "--smoke",
        action="store_true",
        help="on the CPU: 4 clients of the cnn, 2 workers of 1 slot, 2 rounds, synthetic-cifar10: checks the script",
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.device, a.clients, a.workers, a.slots, a.model, a.rounds = "cpu", 4, 2, 1, "cnn", 2
        a.dataset = "synthetic-cifar10"
    return a


class GpuSampler(Sampler):
    """``nvidia-smi`` every ``period_s``: (seconds since start, memory used MiB, utilization %) of one GPU."""

    def __init__(self, index: int, period_s: float = 0.5) -> None:
        super().__init__(period_s)
        self.index = index
        self.samples: list[tuple[float, float, float]] = []
        self.error: str | None = None
        self.t0 = time.monotonic()

    def sample(self) -> bool:
        query = ["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used,utilization.gpu"]
        try:
            out = subprocess.run(
                [*query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5, check=True
            ).stdout
            mem, util = (float(x) for x in out.strip().splitlines()[0].split(","))
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
            self.error = f"{type(e).__name__}: {e}"
            return False
        self.samples.append((time.monotonic() - self.t0, mem, util))
        return True


def residency(logs: Path) -> dict[str, Any]:
    """The workers' ``worker.done`` figures: the largest ``resident_max``, the summed moves."""
    done = []
    for f in sorted(logs.glob("worker-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "worker.done":
                done.append(rec)
    resident = [r["resident_max"] for r in done if "resident_max" in r]  # only workers on an accelerator count
    return {
        "workers_done": len(done),
        "resident_max": max(resident, default=None),
        "offloads": sum(r.get("offloads", 0) for r in done),
        "onloads": sum(r.get("onloads", 0) for r in done),
        "slots_held_max": max((r.get("slots_held_max", 0) for r in done), default=None),
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_fleet: device {a.device} requested but CUDA is not available here; nothing measured", file=sys.stderr
        )
        return 2
    from wafl.cli.launch.hosts import Hosts
    from wafl.cli.launch.launcher import launch
    from wafl.common.config import load_config

    cfg = load_config(
        None,
        {
            "num_clients": a.clients,
            "rounds": a.rounds,
            "model": a.model,
            "dataset": a.dataset,
            "algorithm": "fedavg",
            "protocol": "wait-free",
            "fraction": 1.0,
            "batch_size": a.batch_size,
            "device": a.device,
            "round_deadline_s": a.timeout,
            "join_timeout_s": a.timeout,
        },
    )
    gpu = torch.device(a.device)
    run_dir = Path(tempfile.mkdtemp(prefix="wafl-gpu-fleet-"))
    t0 = time.monotonic()
    error = None
    sampler = GpuSampler(gpu.index or 0) if gpu.type == "cuda" else None
    with sampler or contextlib.nullcontext():
        try:
            s = launch(
                cfg, run_dir, hosts=Hosts(workers=a.workers), show_progress=False, timeout_s=a.timeout, slots=a.slots
            )
        except (TimeoutError, RuntimeError) as e:
            from wafl.cli.launch.launcher import RunSummary, _read_rows

            error = f"{type(e).__name__}: {e}"
            s = RunSummary(run_dir, ok=False, rows=_read_rows(run_dir / "results.jsonl"))
    wall = time.monotonic() - t0
    rounds = [r["round_s"] for r in s.rows]
    steady = rounds[1:] or rounds
    round_s = statistics.median(steady) if steady else None
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(gpu) if gpu.type == "cuda" else a.device,
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "clients": a.clients,
        "workers": a.workers,
        "slots_per_worker": a.slots,
        "model": a.model,
        "dataset": a.dataset,
        "batch_size": a.batch_size,
        "ok": s.ok and len(rounds) == a.rounds,
        "rounds": len(rounds),
        "round_s": [round(x, 3) for x in rounds],
        "round_s_median": round(round_s, 3) if round_s else None,
        "rounds_per_hour": round(3600.0 / round_s, 1) if round_s else None,
        "wall_s": round(wall, 1),
        "gm_accuracy": s.rows[-1].get("gm_accuracy") if s.rows else None,
        **residency(run_dir / "logs"),
        "error": error,
    }
    if sampler is not None:
        first_done = s.rows[0]["wall_s"] if s.rows else 0.0  # seconds from the run's start to round 1's end
        start = wall - (s.rows[-1]["wall_s"] if s.rows else 0.0)  # the run's start on the sampler's clock (about)
        later = [u for t, _, u in sampler.samples if t >= start + first_done]
        result.update(
            gpu_memory_peak_mib=max((m for _, m, _ in sampler.samples), default=None),
            gpu_utilization_mean=round(statistics.mean(later), 1) if later else None,
            gpu_utilization_peak=max((u for _, _, u in sampler.samples), default=None),
            gpu_samples=len(sampler.samples),
            gpu_sampler_error=sampler.error,
        )
    result.update(provenance())
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(table(result) + "\n")
    print(table(result))
    print(f"gpu_fleet: {'ok' if result['ok'] else 'FAILED'}; wrote {out}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if result["ok"] else 1


def table(r: dict[str, Any]) -> str:
    mem = r.get("gpu_memory_peak_mib")
    util = r.get("gpu_utilization_mean")
    rows = [
        ("device", r["device"]),
        ("clients (workers x slots)", f"{r['clients']} ({r['workers']} x {r['slots_per_worker']})"),
        ("model, data", f"{r['model']}, {r['dataset']}, batch {r['batch_size']}"),
        ("rounds finished", f"{r['rounds']} ({'ok' if r['ok'] else 'NOT ok'})"),
        ("round time (median after the first)", f"{r['round_s_median']} s"),
        ("rounds per hour", r["rounds_per_hour"]),
        ("GPU memory in use (peak)", "-" if mem is None else f"{mem:.0f} MiB"),
        ("GPU utilization (mean after round 1)", "-" if util is None else f"{util} %"),
        ("clients resident on the device at once (max)", "-" if r["resident_max"] is None else r["resident_max"]),
        ("offloads / onloads", f"{r['offloads']} / {r['onloads']}"),
        ("final GM accuracy", r["gm_accuracy"]),
        ("wall time", f"{r['wall_s']} s"),
    ]
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


if __name__ == "__main__":
    sys.exit(main())

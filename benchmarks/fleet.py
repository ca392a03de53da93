#!/usr/bin/env python
"""Fleet benchmark: many logical clients hosted in worker processes (``wafl run --workers``).

Run from the repository root (over an hour on a 2-core machine; the paper run alone takes half of it)::

    python benchmarks/fleet.py        # writes benchmarks/results/fleet/fleet.json and fleet.md

Every point is a real ``wafl run`` (``wafl.cli.launch.launcher.launch``: a server process and client
processes over localhost gRPC) of the ``cnn`` on the embedded digits data, FedAvg, wait-free,
``iid`` shards (at 1,000 clients a shard holds one or two of the 1,438 training images), every
client selected every round:

* 10 clients as one process per client and in workers, alternately (``--repeats`` pairs), so
  that both see the same machine load: the round time of the workers over that of the processes;
* 10, 100 and 1,000 clients in workers (``--workers auto``: one per core, each running one
  training at a time per core it gets);
* the paper configuration ``configs/paper/asd-cifar100-delta0.3-100clients.toml`` (FedAvg+ASD,
  ResNet-18, 100 clients, 10 % a round) on ``synthetic-cifar100`` (generated data of
  CIFAR-100's shapes), two rounds, in workers: that its rounds complete, and what it costs.

Measured per run: the server's ``round_s`` of every round (the median over rounds after the
first is the round time: the first includes the clients' first optimizer steps), the time to
the first round's start (processes started, data loaded, models built, every client joined),
and the resident memory (``VmRSS``) of every process this script started, sampled every 0.5 s:
the peak of the sum over the client-hosting processes, divided by the logical clients, is the
memory per logical client (it includes each process's Python, PyTorch and gRPC runtime, which a
worker shares between its clients), and the server's peak. The machine's load average before and
after each run is recorded; other work on the machine shows up in it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from wafl.cli.launch.hosts import Hosts  # noqa: E402
from wafl.cli.launch.launcher import launch, split_clients, worker_slots  # noqa: E402
from wafl.common.config import load_config  # noqa: E402

from benchmarks._machine import Sampler, cpu_name, provenance  # noqa: E402

PAPER = ROOT / "configs" / "paper" / "asd-cifar100-delta0.3-100clients.toml"


class RssSampler(Sampler):
    """Samples the resident memory of this process's children (server, clients, workers) every ``period_s``."""

    def __init__(self, period_s: float = 0.5) -> None:
        super().__init__(period_s)
        self.peak_clients = 0  # bytes: the largest sum over client-hosting processes at one sample
        self.peak_server = 0
        self.peak_each = 0  # the largest single client-hosting process
        self.samples = 0
        self.me = os.getpid()

    def sample(self) -> None:
        clients = server = each = 0
        for _pid, role, rss in _children(self.me):
            if role == "server":
                server += rss
            elif role in ("client", "worker"):
                clients += rss
                each = max(each, rss)
        self.samples += 1
        self.peak_clients = max(self.peak_clients, clients)
        self.peak_server = max(self.peak_server, server)
        self.peak_each = max(self.peak_each, each)


def _children(parent: int) -> list[tuple[int, str, int]]:
    """(pid, wafl role, VmRSS bytes) of the processes whose parent is ``parent``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            argv = (d / "cmdline").read_bytes().split(b"\0")
            role = next((a.decode() for a in argv if a in (b"server", b"client", b"worker")), "other")
            rss = next(
                int(line.split()[1]) * 1024
                for line in (d / "status").read_text().splitlines()
                if line.startswith("VmRSS:")
            )
        except (OSError, ValueError, IndexError, StopIteration):
            continue
        out.append((int(d.name), role, rss))
    return out


def measure(name: str, cfg: Any, workers: int | None, run_dir: Path, timeout_s: float) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    before = os.getloadavg()
    t0 = time.monotonic()
    error = None
    with RssSampler() as rss:
        try:
            s = launch(cfg, run_dir, hosts=Hosts(workers=workers), show_progress=False, timeout_s=timeout_s)
        except (TimeoutError, RuntimeError) as e:  # recorded as a run that did not finish
            from wafl.cli.launch.launcher import RunSummary, _read_rows

            error = f"{type(e).__name__}: {e}"
            s = RunSummary(run_dir, ok=False, rows=_read_rows(run_dir / "results.jsonl"))
    wall = time.monotonic() - t0
    after = os.getloadavg()
    rounds = [r["round_s"] for r in s.rows]
    steady = rounds[1:] or rounds
    n = cfg.federation.num_clients
    procs = workers or n
    row = {
        "name": name,
        "clients": n,
        "mode": "workers" if workers else "process per client",
        "processes": procs,
        "slots_per_worker": worker_slots(workers) if workers else None,
        "clients_per_process": [len(x) for x in split_clients(n, procs)][0],
        "ok": s.ok,
        "rounds": len(s.rows),
        "round_s": [round(x, 3) for x in rounds],
        "round_s_median": round(statistics.median(steady), 3) if steady else None,
        "first_round_start_s": round(s.rows[0]["wall_s"] - s.rows[0]["round_s"], 2) if s.rows else None,
        "wall_s": round(wall, 2),
        "gm_accuracy": s.rows[-1].get("gm_accuracy") if s.rows else None,
        "rss_clients_peak_mb": round(rss.peak_clients / 1e6, 1),
        "rss_per_client_mb": round(rss.peak_clients / 1e6 / n, 3),
        "rss_largest_process_mb": round(rss.peak_each / 1e6, 1),
        "rss_server_peak_mb": round(rss.peak_server / 1e6, 1),
        "rss_samples": rss.samples,
        "load_1m_before": round(before[0], 2),
        "load_1m_after": round(after[0], 2),
        "process_exit_codes": s.client_codes,
        "error": error,
    }
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "clients", ignore_errors=True)
    print(json.dumps(row), flush=True)
    return row


def digits(n: int, rounds: int) -> Any:
    return load_config(
        None,
        {
            "num_clients": n,
            "rounds": rounds,
            "model": "cnn",
            "dataset": "digits",
            "algorithm": "fedavg",
            "protocol": "wait-free",
            "partition": "iid",
            "round_deadline_s": 1800.0,
            "join_timeout_s": 1800.0,
            "device": "cpu",
        },
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| run | clients | mode | processes x slots | rounds ok | round time (median) | first round starts "
        "| RSS of client processes (peak) | per logical client | server RSS | GM acc. | load 1m before/after |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        slots = f" x {r['slots_per_worker']}" if r["slots_per_worker"] else ""
        acc = "-" if r["gm_accuracy"] is None else f"{r['gm_accuracy']:.3f}"
        lines.append(
            f"| {r['name']} | {r['clients']} | {r['mode']} | {r['processes']}{slots} | "
            f"{r['rounds']} {'yes' if r['ok'] else 'NO'} | {r['round_s_median']} s | {r['first_round_start_s']} s | "
            f"{r['rss_clients_peak_mb']:.0f} MB | {r['rss_per_client_mb']:.2f} MB | {r['rss_server_peak_mb']:.0f} MB | "
            f"{acc} | {r['load_1m_before']} / {r['load_1m_after']} |"
        )
    return "\n".join(lines)


def save(rows: list[dict[str, Any]], out: Path, rounds: int) -> None:
    procs = [r["round_s_median"] for r in rows if r["mode"] != "workers" and r["clients"] == 10]
    works = [r["round_s_median"] for r in rows if r["mode"] == "workers" and r["clients"] == 10]
    ratio = round(statistics.mean(works) / statistics.mean(procs), 3) if procs and works else None
    result = {
        **provenance(),
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count()},
        "rounds": rounds,
        "round_time_ratio_10_workers_over_processes": ratio,
        "runs": rows,
    }
    (out / "fleet.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"Fleet benchmark (`python benchmarks/fleet.py`), {os.cpu_count()} CPUs ({cpu_name()}),"
        f" {rounds} rounds per digits run.\n\n{table(rows)}\n\n"
        f"10 clients, round time in workers / as one process per client: {ratio}\n"
    )
    (out / "fleet.md").write_text(md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="10,100,1000", help="logical clients per worker run")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="pairs of 10-client runs (processes, workers)")
    p.add_argument("--no-paper", action="store_true", help="skip the paper configuration")
    p.add_argument(
        "--paper-local-epochs", type=int, help="the paper run's local epochs (default: the configuration's 5)"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet"))
    p.add_argument("--runs", default=str(ROOT / "runs" / "fleet"), help="run folders (models removed)")
    p.add_argument("--smoke", action="store_true", help="4 clients in workers, 2 rounds, no pairs, no paper run")
    a = p.parse_args(argv)
    if a.smoke:
        a.points, a.rounds, a.repeats, a.no_paper = "4", 2, 0, True
    out, runs = Path(a.out), Path(a.runs)
    out.mkdir(parents=True, exist_ok=True)
    from wafl.cli.launch.launcher import default_workers

    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:  # written after every run: a long point that fails keeps the others
        rows.append(row)
        save(rows, out, a.rounds)

    for rep in range(a.repeats):
        cfg = digits(10, a.rounds)
        record(measure(f"10 processes #{rep + 1}", cfg, None, runs / f"p10-{rep}", a.timeout))
        record(measure(f"10 in workers #{rep + 1}", cfg, default_workers(10), runs / f"w10-{rep}", a.timeout))
    points = [int(x) for x in a.points.split(",") if x.strip()]
    for n in [x for x in points if x <= 100]:
        if n == 10 and a.repeats:
            continue  # measured above
        record(measure(f"{n} in workers", digits(n, a.rounds), default_workers(n), runs / f"w{n}", a.timeout))
    if not a.no_paper:
        over: dict[str, Any] = {"dataset": "synthetic-cifar100", "rounds": 2, "device": "cpu"}
        if a.paper_local_epochs:
            over["local_epochs"] = a.paper_local_epochs
        cfg = load_config(str(PAPER), over)
        name = f"paper: {PAPER.stem}, synthetic-cifar100" + (
            f", local_epochs {cfg.training.local_epochs}" * bool(a.paper_local_epochs)
        )
        record(measure(name, cfg, default_workers(cfg.federation.num_clients), runs / "paper", a.timeout))
    for n in [x for x in points if x > 100]:
        record(measure(f"{n} in workers", digits(n, a.rounds), default_workers(n), runs / f"w{n}", a.timeout))
    print((out / "fleet.md").read_text())
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

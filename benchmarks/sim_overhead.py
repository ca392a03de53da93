#!/usr/bin/env python
"""What the in-process simulation costs beyond its training: a workload simulated, then its local training alone.

Run from the repository root::

    python benchmarks/sim_overhead.py                # FedAvg, SCD, FedHKD on digits at 10 and 100 clients
    python benchmarks/sim_overhead.py --profile      # also a cProfile of each simulation (top functions)
    python benchmarks/sim_overhead.py --smoke        # 3 clients, 2 rounds (what the test suite runs)
    python benchmarks/sim_overhead.py --base configs/sweeps/scd_fmnist.toml --rounds 3   # Fashion-MNIST, LeNet-5

For each point (algorithm, clients, rounds; digits, Dirichlet 0.5, the ``cnn``, or the settings of
``--base``; compute-and-wait so that every round's PM trains a fixed ``pm_epochs``, seed 0):

* **simulation**: :func:`wafl.cli.sim.simulate.simulate` with the clients trained in ``--cores`` forked
  processes (``--slots processes``, the default: :class:`~wafl.client.process_slots.ProcessSlots`;
  the engine, the client protocol and the transport stay in the benchmark's process) or in
  ``--cores`` threads of its own process (``--slots threads``: :class:`~wafl.client.compute.SharedSlots`,
  as the clients of a ``wafl worker`` do), one torch thread each: wall-clock of the whole call
  (engine, trainers, rounds, evaluation, results). The models are evaluated after the last round
  only (``--eval-every``, default 0: evaluation is not training; 1 evaluates the global model and
  the clients' models every round, as the sweeps do). Every broadcast a client receives is recorded
  as its ``begin_round`` call is handed to its slot.
* **training alone**: fresh trainers of the same seed (the same shards, the same data order and
  initial models), split over ``--cores`` forked processes (shares of nearly equal samples), replay
  exactly the training the simulation did, in a federation's order (round after round; in a round,
  the process's clients one after another, so each client's state is as far from the caches as in
  any federated run): per round, per client, ``begin_round`` on the broadcast it received, the GM's
  local phases (``train_gm``), the knowledge the algorithm computes (``knowledge``), the PM's epochs
  (``train_pm``). No evaluation, no encoding, no aggregation, no transport. Wall-clock from the fork
  to the last process's exit, trainers built before the clock starts. The same replay in ``--cores``
  threads of one process (``training_alone_threads_s``) tells what Python's GIL leaves of the cores
  to a simulation's training threads from what the federation itself costs; the same replay with each
  client's rounds one after another (``training_alone_by_client_s``, the order of the benchmark before
  it replayed round by round) tells what the round order itself costs the caches.

* **slot calls alone** (with ``--slots processes``): fresh trainers in the same forked slot processes,
  handed exactly the calls the simulation's client protocol hands them (per round, every client at once:
  ``begin_round``, the GM phase in one ``gm_round``, the PM's epochs), and nothing else: no protocol,
  engine, encoding, upload or aggregation. Between training alone and the simulation, it says what the
  hops to the processes cost and what the federation costs beyond them.

Each point also records CPU seconds (``getrusage``): the simulation's own process (event loop, engine,
fold threads; the trainers' building included), its slot processes, the training-alone processes. On
two cores a simulation's CPU bounds its wall-clock from below: half of their sum.

The ratio simulation / training alone is what the federation costs on top of its training
(target: at most 1.3). The JSON names the commit and the load average before and after each
point; figures from a machine shared with other work are not the machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _machine import provenance
from wafl.cli.sim.simulate import simulate
from wafl.client.compute import SharedSlots
from wafl.client.process_slots import ProcessSlots
from wafl.client.trainer import Trainer
from wafl.common.balance import balanced_groups
from wafl.common.config import ConfigError, RunConfig, load_config, read_config_file
from wafl.common.datasets import load_dataset
from wafl.common.logs import configure_logging

RESULTS = Path(__file__).resolve().parent / "results"
ALGORITHMS = ("fedavg", "scd", "fedhkd")
POINTS = {10: 25, 100: 20}  # clients -> rounds
EVAL_EVERY = 0  # the models are evaluated after the last round only (--eval-every)
SLOTS = "processes"  # where the simulation trains its clients (--slots)


def base_settings(path: Path) -> dict[str, Any]:
    """The settings a ``--base`` file gives every point: a sweep file's ``[base]`` table, or a
    configuration file (TOML or JSON) as ``wafl run --config`` reads it."""
    if not path.is_file():
        raise ConfigError(f"--base {str(path)!r} does not exist")
    spec = read_config_file(path)
    base = spec.get("base", {}) if {"base", "grid", "points"} & set(spec) else spec
    if not isinstance(base, dict):
        raise ConfigError(f"--base {str(path)!r}: its [base] must be a table of settings")
    return {k: v for k, v in base.items() if k != "out"}


def workload(
    algorithm: str,
    clients: int,
    rounds: int,
    seed: int = 0,
    base: dict[str, Any] | None = None,
    eval_every: int = EVAL_EVERY,
) -> RunConfig:
    """One point: ``base`` (by default the run defaults: digits, Dirichlet 0.5, the ``cnn``) with the
    point's algorithm, clients and rounds, compute-and-wait, seed, on the CPU, and ``eval_every``
    (by default 0: the models are evaluated after the last round only, evaluation not being training)."""
    over = {
        "algorithm": algorithm,
        "num_clients": clients,
        "rounds": rounds,
        "protocol": "compute-and-wait",
        "seed": seed,
        "device": "cpu",
        "eval_every": eval_every,
    }
    return load_config(None, {**(base or {}), **over})


class Recorder:
    """Wraps the training slots' ``run``: keeps, per client and round, the broadcast it received (the
    arguments of its ``begin_round``), whether its trainer runs in a thread or in a slot process."""

    def __init__(self) -> None:
        self.received: dict[int, list[tuple[int, Any, Any, bool]]] = {}
        self._orig = {cls: cls.run for cls in (SharedSlots, ProcessSlots)}

    def __enter__(self) -> Recorder:
        received = self.received
        for cls, orig in self._orig.items():

            def run(pool: Any, fn: Any, *args: Any, _orig: Any = orig) -> Any:
                if getattr(fn, "__name__", "") == "begin_round" and isinstance(fn.__self__, Trainer):
                    received.setdefault(fn.__self__.index, []).append(_broadcast(*args))
                return _orig(pool, fn, *args)

            cls.run = run  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for cls, orig in self._orig.items():
            cls.run = orig  # type: ignore[method-assign]


def _broadcast(
    round: int, state: Any, knowledge: Any = None, selected: bool = True
) -> tuple[int, dict[str, Any], Any, bool]:
    """``begin_round``'s arguments, as :func:`_replay` gives them back."""
    return round, dict(state), knowledge, selected


def _replay(
    cfg: RunConfig, part: list[Trainer], received: dict[int, list[tuple[int, Any, Any, bool]]], by_client: bool = False
) -> int:
    """The training the simulation did for the clients of ``part``, round after round (in a round, client
    after client), as a federation must order it; the steps it took. ``by_client``: each client's rounds
    one after another instead (its state stays in the caches: no federation can train in that order)."""
    steps = 0
    queues = [(t, received.get(t.index, [])) for t in part]
    order = (
        [(t, q[i]) for t, q in queues for i in range(len(q))]
        if by_client
        else [(t, q[i]) for i in range(max((len(q) for _, q in queues), default=0)) for t, q in queues if i < len(q)]
    )
    for t, (r, state, knowledge, selected) in order:
        t.begin_round(r, state, knowledge, selected)
        if selected:
            steps += t.train_gm().steps
            t.knowledge()
        if t.algorithm.trains_pm(selected) and cfg.client.pm_epochs > 0:
            steps += t.train_pm(None, float(cfg.client.pm_epochs)).steps
    return steps


def train_alone(
    cfg: RunConfig,
    received: dict[int, list[tuple[int, Any, Any, bool]]],
    cores: int,
    mode: str = "processes",
    by_client: bool = False,
) -> dict[str, Any]:
    """Replays the recorded rounds' training split over ``cores`` forked processes (or threads of this
    process, ``mode="threads"``: what Python's GIL leaves of the cores), in a federation's order (or
    ``by_client``: see :func:`_replay`); their wall-clock and steps."""
    data = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    trainers = [Trainer(cfg, i, dataset=data, device="cpu") for i in range(cfg.federation.num_clients)]
    # shares of nearly equal samples, as the simulation's slot processes get them: both cores kept busy
    parts = [[trainers[i] for i in g] for g in balanced_groups([t.num_samples for t in trainers], cores)]
    if mode == "threads":
        from concurrent.futures import ThreadPoolExecutor

        t0 = time.monotonic()
        with ThreadPoolExecutor(cores) as pool:
            steps = list(pool.map(lambda part: _replay(cfg, part, received, by_client), parts))
        return {"wall_s": round(time.monotonic() - t0, 3), "steps": sum(steps), "threads": cores}
    rfd, wfd = os.pipe()
    t0 = time.monotonic()
    pids = []
    for part in parts:
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            try:
                os.write(wfd, f"{_replay(cfg, part, received, by_client)}\n".encode())
            finally:
                os._exit(0)
        pids.append(pid)
    os.close(wfd)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    wall = time.monotonic() - t0
    with os.fdopen(rfd) as f:
        steps = [int(x) for x in f.read().split()]
    if any(codes) or len(steps) != len(parts):
        raise RuntimeError(f"a training-alone process failed: exit codes {codes}")
    return {"wall_s": round(wall, 3), "steps": sum(steps), "processes": cores}


def slot_calls_alone(
    cfg: RunConfig, received: dict[int, list[tuple[int, Any, Any, bool]]], cores: int
) -> dict[str, Any]:
    """The floor of training in slot processes: fresh trainers of the same seed in ``cores``
    :class:`~wafl.client.process_slots.ProcessSlots`, and per recorded round the calls the client
    protocol hands them (``begin_round`` on the broadcast each client received, then, selected, the GM
    phase in one ``gm_round``, and the PM's epochs where the round trains them), every client of a round
    at once as in a federation; no protocol, engine, encoding, upload or aggregation. Wall-clock from the
    fork to the last round's end, and the CPU of this process during them and of the slot processes over their lives."""
    return asyncio.run(_slot_calls(cfg, received, cores))


async def _slot_calls(
    cfg: RunConfig, received: dict[int, list[tuple[int, Any, Any, bool]]], cores: int
) -> dict[str, Any]:
    data = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    trainers = [Trainer(cfg, i, dataset=data, device="cpu") for i in range(cfg.federation.num_clients)]
    children_before, own = _cpu(resource.RUSAGE_CHILDREN), _cpu(resource.RUSAGE_SELF)
    t0 = time.monotonic()  # from the fork, as the simulation's processes start once its trainers are built
    slots = ProcessSlots(cores, trainers)
    steps = 0

    async def client_round(t: Trainer, r: int, state: Any, knowledge: Any, selected: bool) -> int:
        n = 0
        await slots.run(t.begin_round, r, state, knowledge, selected)
        if selected:
            n += (await slots.run(t.gm_round, None, False)).stats.steps
        if t.algorithm.trains_pm(selected) and cfg.client.pm_epochs > 0:
            n += (await slots.run(t.train_pm, None, float(cfg.client.pm_epochs))).steps
        return n

    by_round: dict[int, list[tuple[Trainer, tuple[int, Any, Any, bool]]]] = {}
    for i, q in received.items():
        for b in q:
            by_round.setdefault(b[0], []).append((trainers[i], b))
    try:
        for r in sorted(by_round):
            steps += sum(await asyncio.gather(*(client_round(t, *b) for t, b in by_round[r])))
        wall = time.monotonic() - t0
        own = _cpu(resource.RUSAGE_SELF) - own
    finally:
        slots.shutdown()
    return {
        "wall_s": round(wall, 3),
        "steps": steps,
        "processes": slots.slots,
        "cpu_s": {
            "event_loop_process": round(own, 3),
            "slot_processes": round(_cpu(resource.RUSAGE_CHILDREN) - children_before, 3),
        },
    }


def _cpu(who: int) -> float:
    u = resource.getrusage(who)
    return u.ru_utime + u.ru_stime


def measure(cfg: RunConfig, cores: int, profile: bool, slots: str = SLOTS) -> dict[str, Any]:
    load_before = os.getloadavg()
    prof = cProfile.Profile() if profile else None
    with Recorder() as rec:
        own, children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        if prof is not None:
            prof.enable()
        if slots == "processes":
            rows = simulate(cfg, slot_processes=cores)
        else:
            rows = simulate(cfg, pool=lambda: SharedSlots(cores))
        if prof is not None:
            prof.disable()
        sim_wall = time.monotonic() - t0
        own, children = _cpu(resource.RUSAGE_SELF) - own, _cpu(resource.RUSAGE_CHILDREN) - children
    before = _cpu(resource.RUSAGE_CHILDREN)
    alone = train_alone(cfg, rec.received, cores)
    alone_cpu = _cpu(resource.RUSAGE_CHILDREN) - before  # its forked processes, reaped
    floor = slot_calls_alone(cfg, rec.received, cores) if slots == "processes" else None
    threads = train_alone(cfg, rec.received, cores, "threads")
    by_client = train_alone(cfg, rec.received, cores, by_client=True)
    out: dict[str, Any] = {
        "algorithm": cfg.training.algorithm,
        "clients": cfg.federation.num_clients,
        "rounds": cfg.federation.rounds,
        "slots": slots,
        "simulation_s": round(sim_wall, 3),
        "training_alone_s": alone["wall_s"],
        "ratio": round(sim_wall / alone["wall_s"], 3),
        "training_steps": alone["steps"],
        # CPU seconds: the simulation's own process (event loop, engine, fold threads) and its slot processes
        # (none with --slots threads), against the training-alone processes'
        "simulation_cpu_s": {"event_loop_process": round(own, 3), "slot_processes": round(children, 3)},
        "training_alone_cpu_s": round(alone_cpu, 3),
        "training_alone_threads_s": threads["wall_s"],
        "training_alone_by_client_s": by_client["wall_s"],
        "ratio_to_threads": round(sim_wall / threads["wall_s"], 3),
        # the floor of --slots processes: the same calls to the same slot processes, nothing else (slot_calls_alone)
        "slot_calls_alone": floor,
        "ratio_to_slot_calls": None if floor is None else round(sim_wall / floor["wall_s"], 3),
        "slot_calls_to_training_alone": None if floor is None else round(floor["wall_s"] / alone["wall_s"], 3),
        "gm_accuracy": rows[-1]["gm_accuracy"],
        "pm_accuracy": rows[-1].get("pm_accuracy"),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        out["profile_cumulative_top40"] = s.getvalue().splitlines()[-48:]
        print("\n".join(out["profile_cumulative_top40"]), flush=True)
    return out


def floor_text(r: dict[str, Any]) -> str:
    floor = r["slot_calls_alone"]
    if floor is None:
        return ""
    return f"slot calls alone {floor['wall_s']:.2f} s, {r['slot_calls_to_training_alone']:.2f} x the training; "


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--clients", default="10,100", help="points: client counts (rounds: 25 at 10, 20 at 100)")
    p.add_argument("--rounds", type=int, help="rounds at every point (default: 25 at 10 clients, 20 at 100)")
    p.add_argument(
        "--base",
        type=Path,
        help="settings every point starts from: a sweep file (its [base]) or a configuration file, "
        "e.g. configs/sweeps/scd_fmnist.toml for the Fashion-MNIST setting (default: the run defaults, digits)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=EVAL_EVERY,
        help="the simulation's eval_every (default 0: its models are evaluated after the last round only; "
        "1: the global model and the clients' models every round, as the sweeps do)",
    )
    p.add_argument(
        "--slots",
        choices=("processes", "threads"),
        default=SLOTS,
        help="where the simulation trains: --cores forked processes (default; ProcessSlots) or --cores threads "
        "of its own process (SharedSlots, as a wafl worker)",
    )
    p.add_argument("--cores", type=int, default=min(2, os.cpu_count() or 1), help="training slots / processes")
    p.add_argument("--profile", action="store_true", help="cProfile each simulation (slows it down)")
    p.add_argument("--smoke", action="store_true", help="3 clients, 2 rounds: checks the script")
    p.add_argument("--out", type=Path, help="JSON (default benchmarks/results/sim_overhead[-smoke].json)")
    a = p.parse_args(argv)
    if a.cores < 1:
        p.error("--cores must be at least 1")
    if a.eval_every < 0:
        p.error("--eval-every must be at least 0")
    if a.smoke:
        a.clients, a.rounds = "3", a.rounds or 2
    try:
        base = base_settings(a.base) if a.base else {}
        warm_up = workload("fedavg", 2, 1, base=base)  # also checks the settings before anything runs
    except ConfigError as e:
        p.error(str(e))
    configure_logging("sim_overhead", level="WARNING")
    torch.set_num_threads(1)
    simulate(warm_up)  # untimed: torch's and the dataset's first-use costs are not the first point's
    points = []
    for n in [int(x) for x in a.clients.split(",") if x.strip()]:
        for algo in [x.strip() for x in a.algorithms.split(",") if x.strip()]:
            cfg = workload(algo, n, a.rounds or POINTS.get(n, 20), base=base, eval_every=a.eval_every)
            r = measure(cfg, a.cores, a.profile, a.slots)
            points.append(r)
            print(
                f"{algo:<7} {n:>4} clients {cfg.federation.rounds:>3} rounds: simulation {r['simulation_s']:7.2f} s, "
                "training "
                f"alone {r['training_alone_s']:7.2f} s, ratio {r['ratio']:.2f} ({floor_text(r)}alone in threads "
                f"{r['training_alone_threads_s']:.2f} s, ratio {r['ratio_to_threads']:.2f}; gm {r['gm_accuracy']:.4f}, "
                f"load {r['loadavg_before'][0]:.1f})",
                flush=True,
            )
    doc = {
        "benchmark": "sim_overhead",
        **provenance(),
        "cores_used": a.cores,
        "smoke": a.smoke,
        "base": str(a.base) if a.base else None,
        "base_settings": base,
        "eval_every": a.eval_every,
        "slots": a.slots,
        "points": points,
    }
    out = a.out or RESULTS / ("sim_overhead-smoke.json" if a.smoke else "sim_overhead.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``wafl run``: a server and N client processes on this machine, with progress and a report.

Processes talk over localhost, or, with ``--link-rate``, each in its own network namespace
behind a shaped link (``wafl.cli.launch.netns.Star``). With ``host_cpus`` (``--host-cpus``; by default
``auto`` in ``--link-rate`` mode where control groups can be used), the server and every client
also run in a control group of their own with a CPU quota (``wafl.cli.launch.cgroups``), as on their
own devices. With ``workers`` (``--workers``) the N clients are spread over that many worker
processes (``wafl worker``, :mod:`wafl.client.worker`), each hosting a contiguous range of
indices and running ``slots`` trainings at once; one process per client (the default of
:func:`launch`) is what the wall-clock protocol comparisons use. The output folder gets
``config.json``, ``results.jsonl``, ``reports.jsonl``, ``timelines.json``, ``logs/``,
``accuracy.png`` and, with quotas, ``host_cpus.json``.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wafl.cli.launch import cgroups, forking, netns
from wafl.cli.launch.hosts import Hosts
from wafl.common.balance import balanced_groups
from wafl.common.config import RunConfig
from wafl.common.errors import RunAborted, UsageError
from wafl.common.heterogeneity import MIN_HOST_CPUS, slowdowns
from wafl.common.plateau import ran_to_end


@dataclass
class RunSummary:
    out_dir: Path
    ok: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0
    server_code: int | None = None
    client_codes: list[int | None] = field(default_factory=list)
    host_cpus: dict[str, Any] | None = None  # shares, quotas read back and CPU used (``host_cpus.json``)
    forked: bool = (
        False  # the run's processes were forked from the launcher (wafl.cli.launch.forking), not started afresh
    )

    @property
    def final(self) -> dict[str, Any]:
        return self.rows[-1] if self.rows else {}


def default_out(cfg: RunConfig) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.training.algorithm.replace('+', '_')}-{os.getpid()}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def launch(
    cfg: RunConfig,
    out_dir: Path | None = None,
    hosts: Hosts | None = None,
    show_progress: bool = True,
    timeout_s: float | None = None,
    port: int = 50051,
    slots: int | None = None,
    fork: Callable[[list[str]], int] | None = None,
) -> RunSummary:
    """Runs the federation described by ``cfg`` to its end; returns what it measured.

    ``hosts``: where the processes live, parsed by :func:`wafl.cli.launch.hosts.parse_hosts` (None: the
    default :class:`~wafl.cli.launch.hosts.Hosts`, loopback, shared cores, one process per client). Its
    ``link_rate`` (each client's rate, :func:`wafl.common.heterogeneity.link_rates`) puts every process in a
    network namespace behind a shaped link; its ``host_cpus`` is the CPU share of every host (see
    :func:`wafl.common.heterogeneity.host_cpus`): ``"none"`` shares every core between all processes;
    ``None``: ``auto`` in ``link_rate`` mode when control groups can be used here (otherwise a warning and
    shared cores), else ``none``. ``quota_optional``: whether quotas that cannot be set up here only warn
    (default: only when ``host_cpus`` is None) instead of raising
    :class:`wafl.cli.launch.cgroups.CpuQuotaUnavailable`. ``workers``: host the clients in this many worker
    processes (None: one process per client), each running ``slots`` trainings at once (default: this
    machine's cores shared out between them).
    ``fork``: the ``wafl`` command's entry point (:func:`wafl.cli.main.main`, passed in by the command):
    fork the processes that run without a namespace or control group from this one and run it there, after
    importing what they import (:mod:`wafl.cli.launch.forking`), instead of starting each afresh; ignored
    (processes started afresh) where :func:`wafl.cli.launch.forking.can_fork` says this process may not fork.
    """
    # decided first: what follows imports gRPC (wafl.server.app), after which can_fork says no, while this
    # process has not used gRPC and may still fork (preload imports gRPC too). Only processes without a
    # namespace or control group fork, so with --link-rate or --host-cpus nothing does. The preload's
    # seconds come before any group or namespace exists: a signal during them leaves nothing behind.
    hosts = hosts or Hosts()
    workers = hosts.workers
    may_fork = fork is not None and not hosts.per_client and forking.can_fork()
    if may_fork:
        forking.preload()
    from wafl.client.worker import format_indices
    from wafl.server.app import check_networked

    check_networked(cfg)  # before any process starts
    if workers is not None:
        check_workers(workers, cfg)
        if hosts.per_client:
            raise UsageError(
                "--workers hosts many clients in one process: it has no per-client links (--link-rate) or CPU "
                "shares (--host-cpus); use --workers off for one process per client"
            )
    out = out_dir or default_out(cfg)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for stale in ("results.jsonl", "reports.jsonl", "timelines.json", "server.json", "checkpoint.pt"):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / "clients", ignore_errors=True)  # PMs of an earlier run in this folder would be resumed
    (out / "host_cpus.json").unlink(missing_ok=True)
    ready = out / "server.json"
    star = None
    host = "127.0.0.1"
    bind_port = 0
    if hosts.link_rate:
        netns.check_permissions()
        rates, bits = list(hosts.rates), hosts.rate_bits
        star = netns.Star(
            cfg.federation.num_clients, rates[bits.index(max(bits))], client_rates=rates, server_rate=sum(bits)
        )
        host = star.server_address
        bind_port = port
    try:
        groups, plan = _cpu_groups(cfg, hosts)
    except BaseException:  # cleanup, then re-raised: Ctrl-C here must not leave the namespaces behind either
        if star is not None:
            star.close()
        raise
    proc_cfg = plan.pop("_proc_cfg", cfg)
    forker = functools.partial(forking.fork_main, main=fork) if may_fork and fork is not None else None
    cfg_file = out / "run-config.json"
    cfg_file.write_text(json.dumps(json.loads(proc_cfg.to_json()), indent=2))
    procs: list[Any] = []  # subprocess.Popen or wafl.cli.launch.forking.ForkedProcess
    names: list[str] = []  # each process's host name, as the control groups know it
    t0 = time.monotonic()
    summary = RunSummary(out, ok=False)
    restore = _exit_on_sigterm()
    try:
        prefix = (groups.exec_prefix("server") if groups else []) + (star.exec_prefix("server") if star else [])
        server_cmd = [
            *prefix,
            *MAIN,
            "server",
            "--config",
            str(cfg_file),
            "--host",
            host,
            "--port",
            str(bind_port),
            "--out",
            str(out),
            "--ready-file",
            str(ready),
            "--threads",
            "1",
            "--quiet",
        ]
        token = secrets.token_urlsafe(24)  # this run's join token: only the processes started here know it
        server = _spawn(server_cmd, logs / "server.log", token, forker)
        procs.append(server)
        names.append("server")
        bound = _wait_ready(ready, server, logs / "server.log")
        address = f"{host}:{bound}"
        for w, indices in enumerate(
            split_clients(cfg.federation.num_clients, workers, client_sizes(cfg)) if workers else []
        ):
            cmd = [
                *MAIN,
                "worker",
                "--server",
                address,
                "--clients",
                format_indices(indices),
                "--slots",
                str(slots or worker_slots(workers or 1)),
                *_client_side_args(cfg, out, logs / f"worker-{w}.jsonl"),
            ]
            procs.append(_spawn(cmd, logs / f"worker-{w}.log", token, forker))
            names.append(f"worker{w}")
        for i in range(0 if workers else cfg.federation.num_clients):
            prefix = (groups.exec_prefix(f"client{i}") if groups else []) + (
                star.exec_prefix(f"client{i}") if star else []
            )
            cmd = [
                *prefix,
                *MAIN,
                "client",
                "--server",
                address,
                "--index",
                str(i),
                *_client_side_args(cfg, out, logs / f"client-{i}.jsonl"),
            ]
            procs.append(_spawn(cmd, logs / f"client-{i}.log", token, forker))
            names.append(f"client{i}")
        summary.forked = any(isinstance(p, forking.ForkedProcess) for p in procs)
        progress = Progress(cfg.federation.rounds, enabled=show_progress)
        results = out / "results.jsonl"
        deadline = t0 + timeout_s if timeout_s else float("inf")
        while server.poll() is None:
            _mark_exits(groups, names, procs)
            progress.update(_read_rows(results), time.monotonic() - t0)
            if time.monotonic() > deadline:
                raise RunAborted(f"the run exceeded --timeout {timeout_s:g} s and was stopped; its logs: {logs}")
            dead = [i for i, p in enumerate(procs[1:]) if p.poll() not in (None, 0)]
            if dead and len(dead) == len(procs) - 1:
                raise RunAborted(f"every client process exited with an error; see {logs}/*.log")
            time.sleep(0.2)
        summary.rows = _read_rows(results)
        progress.update(summary.rows, time.monotonic() - t0)
        progress.close()
        summary.server_code = server.returncode
        for p in procs[1:]:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.terminate()
            _mark_exits(groups, names, procs)
        summary.client_codes = [p.poll() for p in procs[1:]]
        summary.ok = server.returncode == 0 and ran_to_end(summary.rows, cfg.federation.rounds)  # or flattened
        if server.returncode != 0:
            print(
                f"wafl: the server exited with code {server.returncode}; last lines of "
                f"{logs / 'server.log'}:\n{_tail(logs / 'server.log')}",
                file=sys.stderr,
            )
    finally:
        try:
            _stop(procs)
            _mark_exits(groups, names, procs)
            if groups is not None:
                groups.close()  # kills anything left in the groups; the usage is kept for the report
                plan["hosts"] = groups.report()["hosts"]
                summary.host_cpus = plan
                (out / "host_cpus.json").write_text(json.dumps(plan, indent=2) + "\n")
        finally:
            if star is not None:
                star.close()
            restore()
    summary.wall_s = time.monotonic() - t0
    return finish_run(summary, cfg, out, show_progress)


def finish_run(summary: RunSummary, cfg: RunConfig, out: Path, show_progress: bool) -> RunSummary:
    """Writes ``summary.json`` and the accuracy plot of a finished run, prints its table; returns ``summary``."""
    (out / "summary.json").write_text(
        json.dumps(
            {
                "ok": summary.ok,
                "wall_s": round(summary.wall_s, 3),
                "final": summary.final,
                "server_code": summary.server_code,
                "client_codes": summary.client_codes,
                "forked": summary.forked,
            },
            indent=2,
        )
    )
    if summary.rows:
        plot_accuracy(summary.rows, out / "accuracy.png", cfg)
    if show_progress:
        print(final_table(summary, cfg))
    return summary


def client_sizes(cfg: RunConfig) -> list[int]:
    """Each client's training samples in the run ``cfg`` describes (the server's partition, from the seed)."""
    from wafl.common.algorithms import registry  # torch and the algorithms: only where workers are balanced
    from wafl.common.datasets import load_dataset
    from wafl.common.partition import run_shards

    public_size = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict()).public_size
    return [
        len(s) for s in run_shards(cfg, load_dataset(cfg.data.dataset, cfg.data.data_dir).train_labels, public_size)
    ]


def split_clients(num_clients: int, workers: int, sizes: Sequence[int] | None = None) -> list[list[int]]:
    """Client indices 0..N-1 in ``workers`` groups. Without ``sizes``: contiguous ranges whose lengths differ
    by at most one. With ``sizes`` (each client's training samples): groups of nearly equal total samples,
    so that no worker trains much longer than the others each round (the largest client goes to the group
    with the fewest samples so far, ties to the lower group; indices ascending within each group)."""
    if sizes is not None:
        if len(sizes) != num_clients:
            raise ValueError(f"split_clients: {len(sizes)} sizes for {num_clients} clients")
        return balanced_groups(sizes, workers)
    base, extra = divmod(num_clients, workers)
    out, start = [], 0
    for w in range(workers):
        n = base + (1 if w < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def check_workers(workers: int, cfg: RunConfig) -> int:
    """``--workers``: a count of worker processes (or actors), 1 to one per client; a :class:`UsageError`
    naming the flag otherwise."""
    if not 1 <= workers <= cfg.federation.num_clients:
        raise UsageError(f"--workers={workers} must lie in 1..{cfg.federation.num_clients} (the clients)")
    return workers


def default_workers(num_clients: int, cores: float | None = None) -> int:
    """``--workers auto``: one worker per core (at most one per client)."""
    return max(1, min(num_clients, int(cores if cores is not None else cgroups.machine_cpus())))


def worker_slots(workers: int, cores: float | None = None) -> int:
    """Trainings at once per worker: this machine's cores shared out between the workers (at least one)."""
    return max(1, int(cores if cores is not None else cgroups.machine_cpus()) // workers)


def _cpu_groups(cfg: RunConfig, hosts: Hosts) -> tuple[Any, dict[str, Any]]:
    """The control groups of a run (or None) and what they were asked for (``host_cpus.json``).

    When the clients are slowed down (``cfg.federation.slowdown``) and get CPU shares, the slow-down is
    expressed by the share (client ``i`` gets ``share_i / slowdown_i`` cores) instead of the
    measured sleeps: the processes then run with ``slowdown = "none"`` (returned under
    ``"_proc_cfg"``), and ``host_cpus.json`` records the factors.
    """
    if hosts.shares is None:
        return None, {}
    cores = hosts.machine_cpus
    server, clients = hosts.shares[0], list(hosts.shares[1])
    plan: dict[str, Any] = {"spec": hosts.cpu_spec, "machine_cpus": cores, "server": server, "clients": clients}
    factors = slowdowns(cfg.federation.slowdown, cfg.federation.num_clients, cfg.federation.seed)
    if any(f > 1.0 for f in factors):
        clients = [max(MIN_HOST_CPUS, c / f) for c, f in zip(clients, factors)]
        plan.update(slowdown=cfg.federation.slowdown, slowdowns=factors, clients=clients, slowdown_by="cpu share")
        proc_cfg = copy.deepcopy(cfg)
        proc_cfg.federation.slowdown = "none"
        plan["_proc_cfg"] = proc_cfg
    total = server + sum(clients)
    plan["total_cpus"] = round(total, 4)
    if total > cores * 1.001:
        print(
            f"wafl: warning: the hosts' CPU shares add up to {total:.2f} cores, more than the {cores:g} here: "
            "they will not all get their share",
            file=sys.stderr,
        )
    try:
        groups = cgroups.CpuGroups({"server": server, **{f"client{i}": c for i, c in enumerate(clients)}})
    except cgroups.CpuQuotaUnavailable as e:
        if not hosts.quota_optional:
            raise
        print(f"wafl: warning: {e.message}; the hosts share every core", file=sys.stderr)
        return None, {}
    plan["hierarchy"] = groups.hierarchy.describe()
    plan["groups"] = str(groups.hierarchy.cpu / groups.name)
    return groups, plan


def _mark_exits(groups: Any, hosts: list[str], procs: list[Any]) -> None:
    if groups is not None:
        for h, p in zip(hosts, procs):
            if p.poll() is not None:
                groups.mark_stopped(h)


def _exit_on_sigterm() -> Any:
    """SIGTERM ends the launcher through its ``finally`` blocks (namespaces and groups removed); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return lambda: None
    return lambda: signal.signal(signal.SIGTERM, old)


MAIN = [sys.executable, "-m", "wafl.cli.main"]


def _client_side_args(cfg: RunConfig, out: Path, log_file: Path) -> list[str]:
    """The arguments a client or worker process shares: its state folder, its log file, one thread, quiet, and
    the run's data folder where it names one."""
    args = ["--state-dir", str(out / "clients"), "--log-file", str(log_file), "--threads", "1", "--quiet"]
    return args + (["--data-dir", cfg.data.data_dir] if cfg.data.data_dir else [])


def _spawn(cmd: list[str], log: Path, token: str = "", forker: Any = None) -> Any:
    """Starts one process; ``token`` travels in its environment (``WAFL_TOKEN``), not its command line.

    With ``forker`` (:func:`wafl.cli.launch.forking.fork_main`) a bare ``python -m wafl.cli.main ARGS`` (no
    namespace or control group in front) is forked from this process instead of started afresh."""
    env = _env()
    if token:
        env["WAFL_TOKEN"] = token
    if forker is not None and cmd[: len(MAIN)] == MAIN:
        return forker(cmd[len(MAIN) :], log, env)
    f = open(log, "wb")
    # Its own process group (killpg, no terminal signals) but the launcher's session: one
    # scheduler autogroup, so that without CPU quotas the wait-free PM's nice value counts
    # against the other processes (with quotas each process is scheduled in its own control
    # group, where autogroups play no part and the nice value ranks the threads of one client).
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, process_group=0)


def _wait_ready(ready: Path, server: Any, log: Path, timeout_s: float = 120.0) -> int:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if ready.exists():
            return int(json.loads(ready.read_text())["port"])
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before listening:\n{_tail(log)}")
        time.sleep(0.05)
    raise RunAborted(f"the server did not start listening within {timeout_s:g} s:\n{_tail(log)}")


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a line being written
    return rows


class Progress:
    """A one-line progress bar over rounds on stderr."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.tty = sys.stderr.isatty()
        self.last = ""
        self.last_done = -1

    def update(self, rows: list[dict[str, Any]], elapsed: float) -> None:
        if not self.enabled:
            return
        done = len(rows)
        if not self.tty and done == self.last_done:
            return  # off a terminal: one line per round, not per tick
        self.last_done = done
        filled = int(self.width * done / self.total)
        last = rows[-1] if rows else {}
        acc = f" gm {last['gm_accuracy']:.3f}" if last.get("gm_accuracy") is not None else ""
        pm = f" pm {last['pm_accuracy']:.3f}" if last.get("pm_accuracy") is not None else ""
        line = (
            f"{chr(13) if self.tty else ''}round {done:>3}/{self.total} "
            f"[{'#' * filled}{'.' * (self.width - filled)}]{acc}{pm} {elapsed:6.1f}s"
        )
        if line != self.last:
            sys.stderr.write(line if self.tty else line + "\n")
            sys.stderr.flush()
            self.last = line

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def final_table(s: RunSummary, cfg: RunConfig) -> str:
    f = s.final
    mb = lambda b: f"{(b or 0) / 1e6:.2f} MB"  # noqa: E731
    up = sum(r.get("bytes_up", 0) for r in s.rows)
    down = sum(r.get("bytes_down", 0) for r in s.rows)
    lines = [
        f"{'run':<16}{cfg.training.algorithm} / {cfg.client.protocol} / {cfg.data.dataset} / "
        f"{cfg.federation.num_clients} clients / {cfg.data.partition}",
        f"{'rounds':<16}{len(s.rows)} of {cfg.federation.rounds}"
        + (f" (stopped: {f['stop_reason']})" if f.get("stop_reason") else ""),
        f"{'gm_accuracy':<16}{_fmt(f.get('gm_accuracy'))}",
        f"{'pm_accuracy':<16}{_fmt(f.get('pm_accuracy'))}",
        f"{'local_accuracy':<16}{_fmt(f.get('local_accuracy'))}",
        f"{'best gm':<16}"
        f"{_fmt(max((r['gm_accuracy'] for r in s.rows if r.get('gm_accuracy') is not None), default=None))}",
        f"{'wall time':<16}{s.wall_s:.1f} s",
        f"{'traffic':<16}up {mb(up)}, down {mb(down)}",
        f"{'output':<16}{s.out_dir}",
        f"{'status':<16}{'ok' if s.ok else 'FAILED'}",
    ]
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def plot_accuracy(rows: list[dict[str, Any]], path: Path, cfg: RunConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rounds = [r["round"] for r in rows]

    def series(field: str) -> list[float]:  # a missing value is a gap in the line
        return [math.nan if r.get(field) is None else float(r[field]) for r in rows]

    ax.plot(rounds, series("gm_accuracy"), marker="o", ms=3, label="GM (global test set)")
    if any(r.get("pm_accuracy") is not None for r in rows):
        ax.plot(rounds, series("pm_accuracy"), marker="s", ms=3, label="PM (local test sets)")
    elif any(r.get("local_accuracy") is not None for r in rows):
        ax.plot(rounds, series("local_accuracy"), marker="^", ms=3, label="local models (local test sets)")
    ax.set_xlabel("round")
    ax.set_ylabel("accuracy")
    ax.set_title(
        f"{cfg.training.algorithm}, {cfg.data.dataset}, {cfg.federation.num_clients} clients, {cfg.data.partition}"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

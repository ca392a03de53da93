"""The measurement run: every server and client process started up front, then the phases in turn, the
raw TCP trials around them and the in-process stage costs; the result goes to :mod:`.report`."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .client import Pool
from .common import MB, log
from .diagnostics import DIAGNOSTICS, SITECUSTOMIZE, STAGE_TIMED_UPLOADS
from .grpc_alone import grpc_alone, upload_message_sizes
from .phases import (
    concurrent_gate_names,
    merge_concurrent,
    phase_concurrent,
    phase_noop,
    phase_single,
    phase_stage_times,
)
from .procfs import loadavg
from .report import TARGETS, load_note, machine_info, print_summary, target_checks, write_result
from .server import Server
from .stage_costs import stage_costs
from .tcp import TcpPair

NOOP_CLIENTS = 5
NOOP_TIMED_ROUND = 2  # not the run's last round (that one also evaluates the model)


def run(a: argparse.Namespace) -> int:
    """Runs the benchmark with the command line's settings ``a``; writes ``a.out``; returns the exit status."""
    t_start = time.monotonic()
    ctx = mp.get_context("spawn")
    workdir = Path(tempfile.mkdtemp(prefix="wafl-bench-transport-"))
    servers: list[Server] = []
    pool: Pool | None = None
    tcp: TcpPair | None = None

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    result: dict[str, Any] = {
        "benchmark": "transport",
        "started_unix": round(time.time(), 1),
        "MB": "10^6 bytes",
        "targets": TARGETS,
    }
    try:
        result["machine"] = machine_info()
        from wafl.cli.report.provenance import git_commit

        result["commit"] = git_commit()
        result["loadavg"] = {"start": loadavg()}
        log(
            f"machine: {result['machine']['nproc']} CPUs, load {result['loadavg']['start']}, python "
            f"{result['machine']['python']}, grpc {result['machine']['grpc']}, torch "
            f"{result['machine']['torch']}"
        )

        size = max(a.concurrent + 1, NOOP_CLIENTS)
        plan: list[tuple[str, dict[str, Any]]] = [
            ("single", {"num_clients": 1, "rounds": a.single_uploads + 2}),
            (f"noop{NOOP_CLIENTS}", {"num_clients": NOOP_CLIENTS, "rounds": NOOP_TIMED_ROUND + 1}),
        ]
        plan += [
            (f"concurrent{a.concurrent}-{i + 1}", {"num_clients": a.concurrent + 1, "rounds": a.concurrent_rounds + 1})
            for i in range(a.concurrent_runs)
        ]
        diagnostics = [d for d in a.diagnostics.split(",") if d and d != "none"]
        unknown = sorted(set(diagnostics) - set(DIAGNOSTICS))
        if unknown:
            raise SystemExit(f"unknown diagnostics {unknown}; known: {sorted(DIAGNOSTICS)}")
        site = workdir / "diagsite"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for d in diagnostics:
            env = {k: v.replace("{dir}", str(workdir / f"diag-{d}")) for k, v in DIAGNOSTICS[d]["env"].items()}
            if any(k.startswith("WAFL_BENCH_") for k in env):
                env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
            if DIAGNOSTICS[d]["kind"] == "concurrent":
                plan.append((f"diag-{d}", {"num_clients": a.concurrent + 1, "rounds": 2, "env": env}))
            else:
                plan.append((f"diag-{d}", {"num_clients": 1, "rounds": STAGE_TIMED_UPLOADS + 1, "env": env}))
        log(f"starting {len(plan)} servers and {size} client processes (spawn; each imports torch and wafl once)")
        t0 = time.monotonic()
        for name, cfg in plan:
            servers.append(Server(workdir, name, **cfg))
        gate_names = [
            g
            for srv in servers
            if srv.name.startswith(("concurrent", "diag-"))
            for g in concurrent_gate_names(srv.name, srv.cfg["rounds"] - 1)
        ]
        gate_names += [f"single:go{r}" for r in range(1, a.single_uploads + 2)]
        pool = Pool(ctx, size, gate_names)
        for srv in servers:
            srv.wait_ready(600.0)
        pool.wait_imported()
        result["startup_s"] = round(time.monotonic() - t0, 1)
        result["loadavg"]["after_startup"] = loadavg()
        log(f"  ready after {result['startup_s']} s")
        time.sleep(2.0)

        log(f"raw TCP loopback: {a.tcp_trials} x {a.tcp_bytes / MB:.0f} MB in 1 MiB sendall/recv_into")
        tcp = TcpPair(ctx)
        tcp_before = [tcp.trial(a.tcp_bytes) for _ in range(a.tcp_trials)]
        log(f"  {[t['MBps'] for t in tcp_before]} MB/s")

        log(
            f"single client: {a.single_uploads} uploads (+1 under cProfile), each right after a "
            f"{a.tcp_paired_bytes / MB:.0f} MB raw TCP trial"
        )
        result["loadavg"]["before_single"] = loadavg()
        single = phase_single(pool, servers[0], a.single_uploads, tcp, a.tcp_paired_bytes)
        log(
            f"  {[u['MBps'] for u in single['uploads']]} MB/s (paired raw TCP "
            f"{[t['MBps'] for t in single['paired_raw_tcp']]}); model {single['model']['model_bytes']} bytes, "
            f"{single['model']['params']} parameters"
        )

        sizes = upload_message_sizes()
        log(
            f"gRPC alone: the {len(sizes)} chunk messages of one upload through a bare grpc.aio stream "
            f"({a.single_uploads} times)"
        )
        result["loadavg"]["before_grpc_alone"] = loadavg()
        galone = grpc_alone(ctx, sizes, a.single_uploads)
        log(
            f"  plain {galone['plain']['MBps']} MB/s; with an executor hop per message "
            f"{galone['executor_hop_per_message']['MBps']} MB/s"
        )

        conc_runs = []
        for srv in servers:
            if not srv.name.startswith("concurrent"):
                continue
            log(
                f"{a.concurrent} concurrent clients (+1 holdout), fresh server {srv.name}, "
                f"{a.concurrent_rounds} round(s)"
            )
            result["loadavg"][f"before_{srv.name}"] = loadavg()
            conc_runs.append(phase_concurrent(pool, srv, a.concurrent, a.concurrent_rounds))
        conc = merge_concurrent(conc_runs)
        for pr in conc["rounds"]:
            log(
                f"  {pr['server']} round {pr['round']}: per-client median {pr['per_client_median_MBps']} min "
                f"{pr['per_client_min_MBps']} aggregate {pr['aggregate_MBps']} MB/s; RSS idle "
                f"{pr['rss']['idle_VmRSS'] / MB:.0f} MB peak {pr['rss']['peak_VmHWM'] / MB:.0f} MB "
                f"(+{pr['rss']['peak_minus_idle_model_multiples']} x model)"
            )

        log(f"no-op round: {NOOP_CLIENTS} clients, round {NOOP_TIMED_ROUND} timed")
        result["loadavg"]["before_noop"] = loadavg()
        noop = phase_noop(pool, servers[1], NOOP_TIMED_ROUND)
        for r in noop["rounds"]:
            log(
                f"  round {r['round']}: server round_s {r['server_round_s']}, client-observed "
                f"{r['first_header_to_last_next_broadcast_s']} s"
            )

        diag_results: dict[str, Any] = {}
        for srv in servers:
            if not srv.name.startswith("diag-"):
                continue
            d = srv.name[len("diag-") :]
            spec = DIAGNOSTICS[d]
            result["loadavg"][f"before_diag_{d}"] = loadavg()
            if spec["kind"] == "single":
                log(f"diagnostic {d}: {STAGE_TIMED_UPLOADS} single-client uploads, {spec['what']}")
                diag_results[d] = {
                    "what": spec["what"],
                    **phase_stage_times(pool, srv, STAGE_TIMED_UPLOADS, Path(srv.env["WAFL_BENCH_STAGE_TIMES"])),
                }
                for u in diag_results[d]["uploads"]:
                    log(
                        f"  round {u['round']}: {u['MBps']} MB/s, {u['seconds']} s: "
                        + ", ".join(f"{k.split(' ')[0]} {v['seconds']} s" for k, v in u["stages"].items())
                    )
                continue
            log(f"diagnostic {d}: {a.concurrent} concurrent uploads, 1 round, {spec['what']}")
            res = phase_concurrent(pool, srv, a.concurrent, 1)
            pr = res["rounds"][0]
            diag_results[d] = {
                "what": spec["what"],
                "server_env": {k: v for k, v in srv.env.items() if k != "PYTHONPATH"},
                "per_client_median_MBps": pr["per_client_median_MBps"],
                "aggregate_MBps": pr["aggregate_MBps"],
                "rss": pr["rss"],
                "server_cpu_s": pr["server_cpu_s"],
                "all_bytes_acknowledged": res["all_bytes_acknowledged"],
            }
            log(
                f"  aggregate {pr['aggregate_MBps']} MB/s; RSS idle {pr['rss']['idle_VmRSS'] / MB:.0f} MB peak "
                f"{pr['rss']['peak_VmHWM'] / MB:.0f} MB (+{pr['rss']['peak_minus_idle_model_multiples']} x "
                "model)"
            )

        log("raw TCP loopback again")
        result["loadavg"]["before_tcp_after"] = loadavg()
        tcp_after = [tcp.trial(a.tcp_bytes) for _ in range(a.tcp_trials)]
        log(f"  {[t['MBps'] for t in tcp_after]} MB/s")

        log("stage costs of the chunk path (in-process)")
        stages = stage_costs()
        result["loadavg"]["end"] = loadavg()

        tcp_all = [t["MBps"] for t in tcp_before + single["paired_raw_tcp"] + tcp_after]
        tcp_median = statistics.median(tcp_all)
        result["raw_tcp"] = {
            "method": (
                "one sender and one receiver process, one connection over 127.0.0.1, 1 MiB sendall / "
                "recv_into, timed from the first send to the receiver's ack of the last byte"
            ),
            "io_size": 1 << 20,
            "before": tcp_before,
            "paired_with_single_uploads": single["paired_raw_tcp"],
            "after": tcp_after,
            "median_MBps": round(tcp_median, 1),
            "best_MBps": max(tcp_all),
            "worst_MBps": min(tcp_all),
        }
        single["ratio_to_raw_tcp_median"] = round(single["median_MBps"] / tcp_median, 4)
        single["ratio_best_to_best_raw_tcp"] = round(single["best_MBps"] / max(tcp_all), 4)
        result["model"] = single["model"]
        result["single_client"] = single
        galone["plain"]["ratio_to_raw_tcp_median"] = round(galone["plain"]["median_MBps"] / tcp_median, 4)
        galone["executor_hop_per_message"]["ratio_to_raw_tcp_median"] = round(
            galone["executor_hop_per_message"]["median_MBps"] / tcp_median, 4
        )
        result["grpc_alone"] = galone
        result["concurrent"] = conc
        result["noop_round"] = noop
        result["diagnostics"] = diag_results
        result["stage_costs"] = stages

        result["checks"] = checks = target_checks(single, conc, noop, tcp_median)
        result["all_pass"] = (
            all(c["pass"] for c in checks.values())
            and single["all_bytes_acknowledged"]
            and conc["all_bytes_acknowledged"]
        )
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        result["load_note"] = load_note(result["loadavg"], result["machine"]["nproc"])

        write_result(result, a.out)
        print_summary(result)
        log(f"wrote {a.out} ({result['wall_s']} s)")
        return 1 if a.strict and not result["all_pass"] else 0
    finally:
        for srv in servers:
            try:
                srv.kill()
            except Exception as e:  # keep cleaning up the others
                log(f"cleanup of server {srv.name}: {e}")
        if pool is not None:
            pool.close()
        if tcp is not None:
            tcp.close()
        if a.keep:
            log(f"server folders kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

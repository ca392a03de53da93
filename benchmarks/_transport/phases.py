"""The measured phases: each drives one server and its clients (tasks on the pool) and returns its figures."""

from __future__ import annotations

import json
import os
import queue
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from .client import Pool
from .common import MB
from .procfs import RssSampler, cpu_delta, thread_cpu
from .server import Server
from .tcp import TcpPair


class Phase:
    """A server and its clients (tasks on the pool); ``close`` stops the server."""

    def __init__(self, pool: Pool, server: Server) -> None:
        self.pool = pool
        self.name = server.name
        self.server = server
        self.address = server.wait_ready()
        self.indices: list[int] = []
        self.done: dict[int, dict[str, Any]] = {}
        self.backlog: list[tuple] = []

    def start_clients(
        self,
        n: int,
        last_round: int,
        gates: dict[int, dict[int, str]] | None = None,
        profile_rounds: list[int] | None = None,
        rss_probe: bool = False,
    ) -> None:
        if n > len(self.pool.procs):
            raise ValueError(f"{n} clients need {n} pool processes, the pool has {len(self.pool.procs)}")
        for i in range(n):
            self.pool.cmd_qs[i].put(
                {
                    "phase": self.name,
                    "address": self.address,
                    "index": i,
                    "gates": (gates or {}).get(i, {}),
                    "last_round": last_round,
                    "server_pid": self.server.pid,
                    "profile_rounds": profile_rounds or [],
                    "rss_probe": rss_probe,
                    "log_file": str(self.server.dir / "logs" / f"bench-client-{i}.jsonl"),
                }
            )
            self.indices.append(i)

    def next_msg(self, timeout: float = 240.0) -> tuple:
        end = time.monotonic() + timeout
        while True:
            try:
                msg = self.pool.msg_q.get(timeout=1.0)
            except queue.Empty:
                if self.server.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name}: server exited with {self.server.proc.returncode}:\n{self.server.console_text()}"
                    ) from None
                dead = [p.name for p in self.pool.procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"{self.name}: client process(es) died: {dead}") from None
                if time.monotonic() > end:
                    raise TimeoutError(f"{self.name}: no message from clients for {timeout:.0f}s") from None
                continue
            if msg[0] != self.name:
                continue  # a late message of an earlier phase
            msg = msg[1:]
            if msg[0] == "error":
                raise RuntimeError(f"{self.name}: client {msg[1]} failed: {msg[2]}")
            if msg[0] == "done":
                self.done[msg[1]] = msg[2]
            return msg

    def wait_for(self, kind: str, count: int, timeout: float = 240.0) -> list[tuple]:
        """The next ``count`` messages of ``kind``; others are kept for later calls, in order."""
        got: list[tuple] = []
        keep: list[tuple] = []
        for msg in self.backlog:
            (got if msg[0] == kind and len(got) < count else keep).append(msg)
        self.backlog = keep
        while len(got) < count:
            msg = self.next_msg(timeout)
            (got if msg[0] == kind else self.backlog).append(msg)
        return got

    def finish(self, timeout: float = 240.0) -> None:
        """Waits for every client's records, then stops the server (its last round never closes)."""
        while len(self.done) < len(self.indices):
            self.next_msg(timeout)
        self.rows = self.server.rows()
        self.server.kill()

    def close(self) -> None:
        self.server.kill()


def phase_single(pool: Pool, server: Server, measured: int, tcp: TcpPair, paired_bytes: int) -> dict[str, Any]:
    """One client, one upload per round; right before each measured upload (the client holds it
    until released) a raw TCP trial runs, so that each upload has a TCP figure taken under the
    same machine load."""
    last = measured + 1  # the last upload runs under cProfile (diagnostics only)
    assert server.cfg["rounds"] == last + 1
    ph = Phase(pool, server)
    ph.start_clients(
        1,
        last_round=last,
        gates={0: {r: f"{ph.name}:go{r}" for r in range(1, last + 1)}},
        profile_rounds=[last],
        rss_probe=True,
    )
    paired: dict[int, dict[str, float]] = {}
    for r in range(1, last + 1):
        ph.wait_for("ready", 1)
        if r <= measured:
            paired[r] = tcp.trial(paired_bytes)
            time.sleep(0.2)
        pool.gates[f"{ph.name}:go{r}"].set()
        ph.wait_for("uploaded", 1)
    ph.finish()
    info = ph.done[0]
    uploads, profiled = [], None
    for rec in info["records"]:
        if "t_up_start" not in rec:
            continue
        secs = rec["t_up_end"] - rec["t_up_start"]
        row = {
            "round": rec["round"],
            "bytes": rec["bytes"],
            "seconds": round(secs, 4),
            "MBps": round(rec["bytes"] / secs / MB, 1) if rec["bytes"] else 0.0,
            "client_cpu_s": rec["client_cpu_s"],
            "server_cpu_s": rec["server_cpu"],
            "server_rss": rec.get("server_rss"),
        }
        if rec.get("profiled"):
            row["profile_top"] = rec["profile_top"]
            profiled = row
        else:
            tcp_row = paired[rec["round"]]
            row["paired_raw_tcp_MBps"] = tcp_row["MBps"]
            row["ratio_to_paired_raw_tcp"] = round(row["MBps"] / tcp_row["MBps"], 4)
            uploads.append(row)
    ok = all(u["bytes"] == info["model_bytes"] for u in uploads)
    return {
        "server_config": server.cfg,
        "model": {k: info[k] for k in ("model_bytes", "params", "float32_params", "tensors")},
        "uploads": uploads,
        "median_MBps": round(statistics.median(u["MBps"] for u in uploads), 1),
        "best_MBps": max(u["MBps"] for u in uploads),
        "median_seconds": round(statistics.median(u["seconds"] for u in uploads), 4),
        "paired_raw_tcp": list(paired.values()),
        "median_ratio_to_paired_raw_tcp": round(statistics.median(u["ratio_to_paired_raw_tcp"] for u in uploads), 4),
        "all_bytes_acknowledged": ok,
        "server_rss_growth_model_multiples": [
            u["server_rss"]["peak_minus_idle_model_multiples"] for u in uploads if u.get("server_rss")
        ],
        "profiled_upload": profiled,
        "server_rounds": ph.rows,
    }


def phase_stage_times(pool: Pool, server: Server, uploads: int, stats_path: Path) -> dict[str, Any]:
    """Single-client uploads with the server's own stage timers read (SIGUSR1) before and after each."""

    def dump(expect: int) -> dict[str, list]:
        os.kill(server.pid, signal.SIGUSR1)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                data = json.loads(stats_path.read_text())
                if data["seq"] >= expect:
                    return data["stats"]
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        raise TimeoutError("the stage-timed server did not write its timers")

    ph = Phase(pool, server)
    ph.start_clients(1, last_round=uploads, gates={0: {r: f"{ph.name}:go{r}" for r in range(1, uploads + 1)}})
    seq, rows = 0, []
    for r in range(1, uploads + 1):
        ph.wait_for("ready", 1)
        seq += 1
        before = dump(seq)
        pool.gates[f"{ph.name}:go{r}"].set()
        _, _, _, t0, t1, n = ph.wait_for("uploaded", 1)[0]
        seq += 1
        after = dump(seq)
        stages = {}
        for k, (calls, secs) in after.items():
            c0, s0 = before.get(k, [0, 0.0])
            if calls - c0 and "per round" not in k:
                stages[k] = {"calls": calls - c0, "seconds": round(secs - s0, 4)}
        rows.append(
            {
                "round": r,
                "bytes": n,
                "seconds": round(t1 - t0, 4),
                "MBps": round(n / (t1 - t0) / MB, 1),
                "stages": stages,
                "unaccounted_s": round((t1 - t0) - sum(v["seconds"] for v in stages.values()), 4),
            }
        )
    ph.finish()
    per_round = {
        k: {"calls": v[0], "seconds_each": round(v[1] / v[0], 4)} for k, v in after.items() if "per round" in k and v[0]
    }
    return {
        "uploads": rows,
        "per_round_costs": per_round,
        "note": (
            "stages: time inside each wrapped function during one upload (the upload's wall time is from "
            "the client's call to Session.upload to its return); the event loop runs decode_upload and "
            "TransferChecker.check, then awaits UploadFold.add in the executor before it reads the next "
            "message, so these times add up rather than overlap; unaccounted = wall - stages (gRPC receive, "
            "asyncio and thread hand-offs, the client)"
        ),
    }


def _downsample(points: list, n: int) -> list:
    if len(points) <= n:
        return points
    step = len(points) / n
    return [points[int(i * step)] for i in range(n)] + [points[-1]]


def concurrent_gate_names(phase: str, rounds: int) -> list[str]:
    return [f"{phase}:{kind}{r}" for r in range(1, rounds + 1) for kind in ("go", "hold")]


def phase_concurrent(pool: Pool, server: Server, n: int, rounds: int) -> dict[str, Any]:
    holdout = n  # index of the extra client that keeps each round open until the peak is read
    assert server.cfg["num_clients"] == n + 1 and server.cfg["rounds"] == rounds + 1
    ph = Phase(pool, server)
    go = {r: pool.gates[f"{ph.name}:go{r}"] for r in range(1, rounds + 1)}
    hold = {r: pool.gates[f"{ph.name}:hold{r}"] for r in range(1, rounds + 1)}
    gates = {i: {r: f"{ph.name}:go{r}" for r in go} for i in range(n)}
    gates[holdout] = {r: f"{ph.name}:hold{r}" for r in hold}
    ph.start_clients(n + 1, last_round=rounds, gates=gates)
    per_round = []
    for r in range(1, rounds + 1):
        ready = ph.wait_for("ready", n + 1)
        assert all(m[2] == r for m in ready), ready
        time.sleep(0.5)  # let the broadcast's last writes and frees settle
        idle = ph.server.status()
        ph.server.reset_peak()
        after_reset = ph.server.status()
        cpu0 = thread_cpu(ph.server.pid)
        sampler = RssSampler(ph.server.pid)
        sampler.start()
        t_release = time.monotonic()
        go[r].set()
        ups = ph.wait_for("uploaded", n)
        peak = ph.server.status()
        sampler.stop()
        cpu1 = thread_cpu(ph.server.pid)
        hold[r].set()
        ph.wait_for("uploaded", 1)  # the holdout's upload closes the round
        starts = [m[3] for m in ups]
        ends = [m[4] for m in ups]
        nbytes = [m[5] for m in ups]
        per_client = sorted(b / (e - s) / MB for s, e, b in zip(starts, ends, nbytes))
        window = (min(starts), max(ends))
        sampled = [rss for t, rss in sampler.samples if window[0] <= t <= window[1]]
        model_bytes_guess = max(nbytes)
        per_round.append(
            {
                "round": r,
                "start_skew_s": round(max(starts) - min(starts), 4),
                "release_to_first_start_s": round(min(starts) - t_release, 4),
                "upload_seconds": sorted(round(e - s, 4) for s, e in zip(starts, ends)),
                "per_client_MBps": [round(x, 1) for x in per_client],
                "per_client_median_MBps": round(statistics.median(per_client), 1),
                "per_client_min_MBps": round(min(per_client), 1),
                "aggregate_MBps": round(sum(nbytes) / (window[1] - window[0]) / MB, 1),
                "window_s": round(window[1] - window[0], 4),
                "bytes_each": nbytes,
                "rss": {
                    "idle_VmRSS": idle["VmRSS"],
                    "VmHWM_before_reset": idle["VmHWM"],
                    "VmHWM_after_reset": after_reset["VmHWM"],
                    "peak_VmHWM": peak["VmHWM"],
                    "VmRSS_after_uploads": peak["VmRSS"],
                    "sampled_max_VmRSS": max(sampled) if sampled else None,
                    "idle_breakdown": {k: idle.get(k) for k in ("RssAnon", "RssFile", "RssShmem")},
                    "after_uploads_breakdown": {k: peak.get(k) for k in ("RssAnon", "RssFile", "RssShmem")},
                    "timeline_ms_MB": _downsample(
                        [(round((t - t_release) * 1000), round(v / MB, 1)) for t, v in sampler.samples], 60
                    ),
                    "samples": len(sampled),
                    "peak_minus_idle": peak["VmHWM"] - idle["VmRSS"],
                    "peak_minus_idle_model_multiples": round((peak["VmHWM"] - idle["VmRSS"]) / model_bytes_guess, 3),
                },
                "server_cpu_s": cpu_delta(ph.server.pid, cpu0, cpu1),
            }
        )
    ph.finish()
    model_bytes = ph.done[0]["model_bytes"]
    all_ok = all(all(b == model_bytes for b in pr["bytes_each"]) for pr in per_round)
    per_client_all = [x for pr in per_round for x in pr["per_client_MBps"]]
    worst = max(per_round, key=lambda pr: pr["rss"]["peak_minus_idle"])
    return {
        "server": ph.name,
        "server_config": ph.server.cfg,
        "clients_uploading": n,
        "holdout_client": (
            f"client-{holdout} (joined and selected; uploads after the peak was read so that the round stays open)"
        ),
        "rounds": per_round,
        "per_client_median_MBps": round(statistics.median(per_client_all), 1),
        "per_client_min_MBps": round(min(per_client_all), 1),
        "aggregate_MBps_median": round(statistics.median(pr["aggregate_MBps"] for pr in per_round), 1),
        "all_bytes_acknowledged": all_ok,
        "model_bytes": model_bytes,
        "rss_worst_round": {
            "round": worst["round"],
            "idle_VmRSS": worst["rss"]["idle_VmRSS"],
            "peak_VmHWM": worst["rss"]["peak_VmHWM"],
            "peak_minus_idle": worst["rss"]["peak_minus_idle"],
            "peak_minus_idle_model_multiples": round(worst["rss"]["peak_minus_idle"] / model_bytes, 3),
        },
        "server_rounds": ph.rows,
    }


def merge_concurrent(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary over several fresh servers (each run's rounds kept as measured)."""
    rounds = [dict(pr, server=run["server"]) for run in runs for pr in run["rounds"]]
    per_client_all = [x for pr in rounds for x in pr["per_client_MBps"]]
    model_bytes = runs[0]["model_bytes"]
    worst = max(rounds, key=lambda pr: pr["rss"]["peak_minus_idle"])
    return {
        "server_config": runs[0]["server_config"],
        "clients_uploading": runs[0]["clients_uploading"],
        "holdout_client": runs[0]["holdout_client"],
        "runs": len(runs),
        "rounds": rounds,
        "per_client_median_MBps": round(statistics.median(per_client_all), 1),
        "per_client_min_MBps": round(min(per_client_all), 1),
        "aggregate_MBps": [pr["aggregate_MBps"] for pr in rounds],
        "aggregate_MBps_median": round(statistics.median(pr["aggregate_MBps"] for pr in rounds), 1),
        "all_bytes_acknowledged": all(run["all_bytes_acknowledged"] for run in runs),
        "model_bytes": model_bytes,
        "rss_first_round_model_multiples": [
            pr["rss"]["peak_minus_idle_model_multiples"] for pr in rounds if pr["round"] == 1
        ],
        "rss_worst_round": {
            "server": worst["server"],
            "round": worst["round"],
            "idle_VmRSS": worst["rss"]["idle_VmRSS"],
            "peak_VmHWM": worst["rss"]["peak_VmHWM"],
            "peak_minus_idle": worst["rss"]["peak_minus_idle"],
            "peak_minus_idle_model_multiples": round(worst["rss"]["peak_minus_idle"] / model_bytes, 3),
        },
        "server_rounds": {run["server"]: run["server_rounds"] for run in runs},
    }


def phase_noop(pool: Pool, server: Server, timed_round: int) -> dict[str, Any]:
    n, rounds = server.cfg["num_clients"], server.cfg["rounds"]
    ph = Phase(pool, server)
    ph.start_clients(n, last_round=rounds - 1)
    ph.finish()
    by_client = {i: {rec["round"]: rec for rec in ph.done[i]["records"]} for i in ph.done}
    rows = {row["round"]: row for row in ph.rows}
    out_rounds = []
    for r in range(1, rounds):
        cur = [by_client[i][r] for i in by_client]
        nxt = [by_client[i][r + 1] for i in by_client]
        header_to_header = [b["t_header"] - a["t_header"] for a, b in zip(cur, nxt)]
        model_to_model = [b["t_model"] - a["t_model"] for a, b in zip(cur, nxt)]
        uploads = [a["t_up_end"] - a["t_up_start"] for a in cur]
        out_rounds.append(
            {
                "round": r,
                "server_round_s": rows.get(r, {}).get("round_s"),
                "first_header_to_last_next_broadcast_s": round(
                    max(b["t_model"] for b in nxt) - min(a["t_header"] for a in cur), 4
                ),
                "last_broadcast_complete_to_last_next_broadcast_s": round(
                    max(b["t_model"] for b in nxt) - max(a["t_model"] for a in cur), 4
                ),
                "per_client_header_to_next_header_s": [round(x, 4) for x in header_to_header],
                "per_client_broadcast_to_next_broadcast_s": [round(x, 4) for x in model_to_model],
                "broadcast_download_s": [round(a["t_model"] - a["t_header"], 4) for a in cur],
                "upload_s": [round(x, 4) for x in uploads],
                "upload_window_s": round(max(a["t_up_end"] for a in cur) - min(a["t_up_start"] for a in cur), 4),
                "last_upload_end_to_first_next_header_s": round(
                    min(b["t_header"] for b in nxt) - max(a["t_up_end"] for a in cur), 4
                ),
            }
        )
    timed = out_rounds[timed_round - 1]
    return {
        "server_config": ph.server.cfg,
        "clients": n,
        "timed_round": timed_round,
        "rounds": out_rounds,
        "server_round_s": timed["server_round_s"],
        "client_observed_s": timed["first_header_to_last_next_broadcast_s"],
        "definition": (
            "client_observed_s: from the first client's receipt of the round's broadcast header to "
            "the moment the last client holds the next broadcast complete (broadcast download + 5 uploads + "
            "aggregation + next broadcast download); server_round_s: results.jsonl round_s (round opened, "
            "broadcast encoded, uploads, aggregation)"
        ),
        "server_rounds": list(rows.values()),
    }

#!/usr/bin/env python
"""Transport benchmark: model uploads over loopback gRPC against the real ``wafl server``.

Run from the repository root::

    python benchmarks/transport.py            # writes benchmarks/results/transport.json

What it measures, all in one run, on this machine:

* raw TCP over 127.0.0.1 (a sender and a receiver process, 1 MiB ``sendall``/``recv_into``),
  before and after the gRPC phases: the ceiling a transport could reach here;
* one client uploading an 11.18M-parameter float32 model (ResNet-18 with code_len 32,
  44.7 MB) to a server with ``num_clients=1``: one upload per round, the time from the call to
  ``Session.upload`` to its return (the server acknowledges once every chunk is validated and
  folded into the running sum);
* ten clients, each in its own process, uploading at the same moment (released together by
  one ``multiprocessing.Event`` after every one of them received the round's broadcast):
  per-client MB/s, aggregate MB/s (all bytes / first start to last finish), and the server's
  resident memory: idle ``VmRSS`` right before the uploads, then ``VmHWM`` after they finished
  (the peak is reset with ``/proc/<pid>/clear_refs`` = 5 right before). An eleventh, joined
  client holds its own upload back until the peak has been read, so the round stays open and
  the reading covers the ten uploads only, not the aggregation, broadcast and evaluation that
  follow the round's last upload;
* a no-op round: five clients that upload the model they receive at once, three rounds;
  round 2 (not the last one, which also evaluates the model) is timed from the clients' side
  and by the server's own ``round_s`` in ``results.jsonl``;
* diagnostics: the server's CPU time per thread during the uploads, the cost of each stage of
  the chunk path measured in-process on the same chunks, and a cProfile of one client upload.

Benchmark clients use ``wafl.client.session.Session``, the transport real clients use; they skip
training and upload the received global state as is. MB = 10^6 bytes throughout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "transport.json"
MB = 1e6
CLK_TCK = os.sysconf("SC_CLK_TCK")
NUM_SAMPLES = 100

TARGETS = {
    "single_upload_vs_raw_tcp_min_ratio": 0.20,
    "concurrent_peak_rss_growth_max_model_multiples": 4.0,
    "noop_round_max_s": 2.0,
}

SERVER_BASE_CONFIG = {
    "dataset": "synthetic-cifar10",
    "model": "resnet18",
    "code_len": 32,
    "eval_every": 0,
    "checkpoint": False,
    "round_deadline_s": 300,
    "join_timeout_s": 300,
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# --------------------------------------------------------------------------- /proc readers
def proc_status(pid: int) -> dict[str, int]:
    """VmRSS / VmHWM / ... of a process, in bytes."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Vm") and line.endswith("kB"):
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, user+system CPU seconds) for every thread of ``pid``."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) / CLK_TCK)
    return out


def cpu_delta(pid: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two ``thread_cpu`` readings, by thread group."""
    groups: dict[str, float] = {}
    for tid, (comm, t1) in after.items():
        t0 = before.get(tid, (comm, 0.0))[1]
        name = "main (asyncio event loop)" if tid == pid else f"other threads named {comm!r}"
        groups[name] = groups.get(name, 0.0) + (t1 - t0)
    groups = {k: round(v, 3) for k, v in sorted(groups.items()) if v > 0}
    groups["total"] = round(sum(groups.values()), 3)
    return groups


# --------------------------------------------------------------------------- raw TCP
def _tcp_receiver(port_q: Any, total: int, bufsize: int) -> None:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(bufsize))
    got = 0
    while got < total:
        n = conn.recv_into(buf)
        if n == 0:
            break
        got += n
    conn.sendall(got.to_bytes(8, "little"))
    conn.close()
    srv.close()


def _tcp_sender(port: int, total: int, bufsize: int, result_q: Any) -> None:
    payload = os.urandom(bufsize)
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    sent = 0
    while sent < total:
        s.sendall(payload)
        sent += len(payload)
    ack = b""
    while len(ack) < 8:
        part = s.recv(8 - len(ack))
        if not part:
            break
        ack += part
    t1 = time.perf_counter()
    s.close()
    result_q.put((int.from_bytes(ack, "little"), t1 - t0))


def raw_tcp(ctx: Any, procs: list, total: int, bufsize: int, trials: int) -> list[dict[str, float]]:
    total = -(-total // bufsize) * bufsize  # whole buffers
    out = []
    for _ in range(trials):
        port_q, result_q = ctx.Queue(), ctx.Queue()
        rx = ctx.Process(target=_tcp_receiver, args=(port_q, total, bufsize), daemon=True)
        rx.start()
        procs.append(rx)
        port = port_q.get(timeout=60)
        tx = ctx.Process(target=_tcp_sender, args=(port, total, bufsize, result_q), daemon=True)
        tx.start()
        procs.append(tx)
        got, secs = result_q.get(timeout=120)
        tx.join(10)
        rx.join(10)
        if got != total:
            raise RuntimeError(f"raw TCP: receiver counted {got} of {total} bytes")
        out.append({"bytes": total, "seconds": round(secs, 4), "MBps": round(total / secs / MB, 1)})
    return out


# --------------------------------------------------------------------------- benchmark client
def _worker(slot: int, cmd_q: Any, msg_q: Any, gates: dict[str, Any]) -> None:
    """A client process, started once and reused by every phase (torch imports once per process).

    Each task is one client of one run: ``{"phase", "address", "index", "gates": {round: gate
    name}, "last_round", "server_pid", "profile_rounds", "log_file"}``.
    """
    import torch

    import wafl.client.session  # noqa: F401  (warm imports before the first measurement)

    torch.set_num_threads(1)
    msg_q.put(("imported", slot))
    while True:
        task = cmd_q.get()
        if task is None:
            return
        try:
            asyncio.run(_client(task, msg_q, gates))
        except BaseException as e:  # reported to the parent, which fails the phase
            import traceback

            msg_q.put((task["phase"], "error", task["index"], f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            if not isinstance(e, Exception):
                raise


async def _client(task: dict[str, Any], msg_q: Any, gates: dict[str, Any]) -> None:
    """Joins, then uploads every broadcast model at once (after its gate, if the round has one);
    stops on the broadcast of round ``last_round + 1`` so that the run's last round, which also
    evaluates the model, never has to complete."""
    from wafl.client.session import Session
    from wafl.common.codec import RawChunk
    from wafl.common.logs import configure_logging
    from wafl.common.proto import federation_pb2 as pb
    from wafl.common.wire import decode_broadcast

    phase, index, server_pid = task["phase"], task["index"], task["server_pid"]
    configure_logging(f"bench-client-{index}", task["log_file"], level="WARNING", console=False)
    session = Session(task["address"], f"client-{index}", index, NUM_SAMPLES, [NUM_SAMPLES // 10] * 10, reconnect_s=60.0)
    await session.join()
    model_bytes = sum(s.nbytes for s in session.manifest)
    params = sum(s.numel for s in session.manifest)
    float32_params = sum(s.numel for s in session.manifest if s.dtype == pb.FLOAT32)

    # Time-stamp each broadcast header as the client reads it (same decoder, same stream).
    header_t: dict[int, float] = {}

    def timed_decode(raw: bytes) -> Any:
        m = decode_broadcast(raw)
        if not isinstance(m, RawChunk) and m.WhichOneof("kind") == "header":
            header_t[m.header.round] = time.monotonic()
        return m

    assert session._channel is not None  # opened by join()
    session._broadcasts = session._channel.unary_stream(
        "/wafl.v1.Federation/Broadcasts", request_serializer=pb.BroadcastRequest.SerializeToString, response_deserializer=timed_decode
    )

    loop = asyncio.get_running_loop()
    records: list[dict[str, Any]] = []
    try:
        async for model in session.models():
            t_model = time.monotonic()
            rec: dict[str, Any] = {"round": model.round, "t_header": header_t.get(model.round), "t_model": t_model, "final": model.final}
            records.append(rec)
            if model.final:
                await session.report(model.round - 1, {"final": 1.0})
                break
            if model.round > task["last_round"]:
                break
            if session.client_id not in model.selected:
                continue
            gate_name = task["gates"].get(model.round)
            if gate_name is not None:
                msg_q.put((phase, "ready", index, model.round, time.monotonic()))
                if not await loop.run_in_executor(None, gates[gate_name].wait, 240.0):
                    raise TimeoutError(f"round {model.round}: never released")
            prof = None
            if model.round in task["profile_rounds"]:
                import cProfile

                prof = cProfile.Profile()
            srv0 = thread_cpu(server_pid)
            cpu0 = time.process_time()
            if prof is not None:
                prof.enable()
            t0 = time.monotonic()
            n = await session.upload(model.round, model.state, NUM_SAMPLES, {})
            t1 = time.monotonic()
            if prof is not None:
                prof.disable()
            cpu1 = time.process_time()
            srv1 = thread_cpu(server_pid)
            rec.update(t_up_start=t0, t_up_end=t1, bytes=n, client_cpu_s=round(cpu1 - cpu0, 3), server_cpu=cpu_delta(server_pid, srv0, srv1), profiled=prof is not None)
            if prof is not None:
                rec["profile_top"] = _profile_top(prof, 14)
            msg_q.put((phase, "uploaded", index, model.round, t0, t1, n))
    finally:
        await session.close()
    msg_q.put((phase, "done", index, {"records": records, "model_bytes": model_bytes, "params": params, "float32_params": float32_params, "tensors": len(session.manifest)}))


class Pool:
    """``size`` client processes (spawned, so each has its own interpreter and GIL)."""

    def __init__(self, ctx: Any, size: int, gate_names: list[str]) -> None:
        self.ctx = ctx
        self.msg_q = ctx.Queue()
        self.gates = {name: ctx.Event() for name in gate_names}
        self.cmd_qs = [ctx.Queue() for _ in range(size)]
        self.procs = [ctx.Process(target=_worker, args=(i, self.cmd_qs[i], self.msg_q, self.gates), daemon=True, name=f"bench-client-worker-{i}") for i in range(size)]
        for p in self.procs:
            p.start()

    def wait_imported(self, timeout: float = 300.0) -> None:
        pending = set(range(len(self.procs)))
        end = time.monotonic() + timeout
        while pending:
            try:
                msg = self.msg_q.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self.procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"client worker(s) died while importing: {dead}")
                if time.monotonic() > end:
                    raise TimeoutError("client workers did not start")
                continue
            if msg[0] == "imported":
                pending.discard(msg[1])

    def close(self) -> None:
        for q, p in zip(self.cmd_qs, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self.procs:
            p.join(3)
            if p.is_alive():
                p.terminate()
                p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)


def _profile_top(prof: Any, n: int) -> list[dict[str, Any]]:
    import pstats

    st = pstats.Stats(prof)
    total = st.total_tt or 1e-9
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4), "tottime_share": round(tt / total, 3)})
    rows.sort(key=lambda r: -r["tottime_s"])
    return [{"profiled_s": round(total, 4)}] + rows[:n]


# --------------------------------------------------------------------------- server
class Server:
    def __init__(self, workdir: Path, name: str, **cfg: Any) -> None:
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        self.cfg = {**SERVER_BASE_CONFIG, **cfg}
        cfg_path = self.dir / "config.in.json"
        cfg_path.write_text(json.dumps(self.cfg))
        self.ready = self.dir / "server.json"
        self.console = open(self.dir / "console.txt", "wb")
        cmd = [sys.executable, "-m", "wafl.cli.main", "server", "--config", str(cfg_path), "--host", "127.0.0.1", "--port", "0", "--out", str(self.dir), "--ready-file", str(self.ready), "--quiet", "--threads", "1"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.console, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        self.port = 0

    def wait_ready(self, timeout: float = 120.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before listening:\n{self.console_text()}")
            if self.ready.exists():
                self.port = json.loads(self.ready.read_text())["port"]
                return f"127.0.0.1:{self.port}"
            time.sleep(0.05)
        raise TimeoutError("server did not write its ready file")

    def console_text(self) -> str:
        try:
            return (self.dir / "console.txt").read_text()[-4000:]
        except OSError:
            return ""

    def status(self) -> dict[str, int]:
        return proc_status(self.pid)

    def reset_peak(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def rows(self) -> list[dict[str, Any]]:
        p = self.dir / "results.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.console.close()


class Phase:
    """A server and its clients (tasks on the pool); ``close`` stops the server."""

    def __init__(self, pool: Pool, workdir: Path, name: str, registry: list, **cfg: Any) -> None:
        self.pool = pool
        self.name = name
        self.server = Server(workdir, name, **cfg)
        registry.append(self)
        self.address = self.server.wait_ready()
        self.indices: list[int] = []
        self.done: dict[int, dict[str, Any]] = {}
        self.backlog: list[tuple] = []

    def start_clients(self, n: int, last_round: int, gates: dict[int, dict[int, str]] | None = None, profile_rounds: list[int] | None = None) -> None:
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
                    raise RuntimeError(f"{self.name}: server exited with {self.server.proc.returncode}:\n{self.server.console_text()}")
                dead = [p.name for p in self.pool.procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"{self.name}: client process(es) died: {dead}")
                if time.monotonic() > end:
                    raise TimeoutError(f"{self.name}: no message from clients for {timeout:.0f}s")
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


class RssSampler(threading.Thread):
    """Polls a process's VmRSS every few milliseconds (a cross-check of VmHWM)."""

    def __init__(self, pid: int, period_s: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, int]] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self.samples.append((time.monotonic(), proc_status(self.pid)["VmRSS"]))
            except (FileNotFoundError, ProcessLookupError, KeyError):
                return
            time.sleep(self.period_s)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(2)


# --------------------------------------------------------------------------- phases
def phase_single(pool: Pool, workdir: Path, registry: list, measured: int) -> dict[str, Any]:
    last = measured + 1  # the last upload runs under cProfile (diagnostics only)
    ph = Phase(pool, workdir, "single", registry, num_clients=1, rounds=last + 1)
    ph.start_clients(1, last_round=last, profile_rounds=[last])
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
        }
        if rec.get("profiled"):
            row["profile_top"] = rec["profile_top"]
            profiled = row
        else:
            uploads.append(row)
    ok = all(u["bytes"] == info["model_bytes"] for u in uploads)
    return {
        "server_config": ph.server.cfg,
        "model": {k: info[k] for k in ("model_bytes", "params", "float32_params", "tensors")},
        "uploads": uploads,
        "median_MBps": round(statistics.median(u["MBps"] for u in uploads), 1),
        "median_seconds": round(statistics.median(u["seconds"] for u in uploads), 4),
        "all_bytes_acknowledged": ok,
        "profiled_upload": profiled,
        "server_rounds": ph.rows,
    }


def concurrent_gate_names(rounds: int) -> list[str]:
    return [f"{kind}{r}" for r in range(1, rounds + 1) for kind in ("go", "hold")]


def phase_concurrent(pool: Pool, workdir: Path, registry: list, n: int, rounds: int) -> dict[str, Any]:
    holdout = n  # index of the extra client that keeps each round open until the peak is read
    ph = Phase(pool, workdir, f"concurrent{n}", registry, num_clients=n + 1, rounds=rounds + 1)
    go = {r: pool.gates[f"go{r}"] for r in range(1, rounds + 1)}
    hold = {r: pool.gates[f"hold{r}"] for r in range(1, rounds + 1)}
    gates = {i: {r: f"go{r}" for r in go} for i in range(n)}
    gates[holdout] = {r: f"hold{r}" for r in hold}
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
        "server_config": ph.server.cfg,
        "clients_uploading": n,
        "holdout_client": f"client-{holdout} (joined and selected; uploads after the peak was read so that the round stays open)",
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


def phase_noop(pool: Pool, workdir: Path, registry: list, n: int, rounds: int, timed_round: int) -> dict[str, Any]:
    ph = Phase(pool, workdir, f"noop{n}", registry, num_clients=n, rounds=rounds)
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
                "first_header_to_last_next_broadcast_s": round(max(b["t_model"] for b in nxt) - min(a["t_header"] for a in cur), 4),
                "last_broadcast_complete_to_last_next_broadcast_s": round(max(b["t_model"] for b in nxt) - max(a["t_model"] for a in cur), 4),
                "per_client_header_to_next_header_s": [round(x, 4) for x in header_to_header],
                "per_client_broadcast_to_next_broadcast_s": [round(x, 4) for x in model_to_model],
                "broadcast_download_s": [round(a["t_model"] - a["t_header"], 4) for a in cur],
                "upload_s": [round(x, 4) for x in uploads],
                "last_upload_end_to_first_next_header_s": round(min(b["t_header"] for b in nxt) - max(a["t_up_end"] for a in cur), 4),
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
        "definition": "client_observed_s: from the first client's receipt of the round's broadcast header to the moment the last client holds the next broadcast complete (broadcast download + 5 uploads + aggregation + next broadcast download); server_round_s: results.jsonl round_s (round opened, broadcast encoded, uploads, aggregation)",
        "server_rounds": list(rows.values()),
    }


# --------------------------------------------------------------------------- stage costs
def stage_costs(repeat: int = 3) -> dict[str, Any]:
    """Per-MB cost of each step of the chunk path, on the benchmark's own model, in this process."""
    import zlib

    import numpy as np
    import torch

    from wafl.common.codec import TransferChecker, iter_chunks, manifest_of, numpy_view
    from wafl.common.models import build_model
    from wafl.common.wire import decode_upload, encode_upload
    from wafl.server.aggregator import Accumulator

    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = {k: v.detach().clone().contiguous() for k, v in build_model("resnet18", 10, 3, 32, 32).state_dict().items()}
    manifest = manifest_of(state)
    nbytes = sum(s.nbytes for s in manifest)
    chunks = list(iter_chunks(state.items()))
    encoded = [encode_upload(c) for c in chunks]
    spec_by_name = {s.name: s for s in manifest}

    def best(fn) -> float:  # type: ignore[no-untyped-def]
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def memcpy() -> None:
        dst = bytearray((1 << 20) + 1024)
        for e in encoded:
            memoryview(dst)[: len(e)] = e

    def crc() -> None:
        c = 0
        for ch in chunks:
            c = zlib.crc32(ch.data, c)

    decoded = [decode_upload(e) for e in encoded]

    def check() -> None:
        ck = TransferChecker(manifest, require_finite=False)
        for d in decoded:
            ck.check(d)

    def fold_whole() -> None:
        acc = Accumulator(manifest)
        fold = acc.begin(float(NUM_SAMPLES))
        for d in decoded:
            fold.add(spec_by_name[d.name], d)
        fold.commit()

    acc = Accumulator(manifest)
    for s in manifest:  # touch the sums once so that the parts below time warm pages
        acc.sums[s.name][:] = 0.0
    views = [(spec_by_name[d.name], d, numpy_view(d.data, spec_by_name[d.name].dtype)) for d in decoded]
    contribs = [np.multiply(v, 100.0, dtype=np.float64) for _, _, v in views]

    def f_multiply() -> None:
        for _, _, v in views:
            np.multiply(v, 100.0, dtype=np.float64)

    def f_sum() -> None:
        for c in contribs:
            float(c.sum())

    def f_spill() -> None:
        with tempfile.TemporaryFile() as f:
            for _, d, _ in views:
                f.write(d.data)

    def f_add() -> None:
        for (spec, d, v), c in zip(views, contribs):
            start = d.offset // v.itemsize
            acc.sums[spec.name][start : start + v.size] += c

    def f_mean() -> None:
        a = Accumulator(manifest)
        fold = a.begin(float(NUM_SAMPLES))
        for d in decoded:
            fold.add(spec_by_name[d.name], d)
        fold.commit()
        t0 = time.perf_counter()
        a.mean()
        f_mean.t = time.perf_counter() - t0  # type: ignore[attr-defined]

    steps = {
        "client: encode_upload (protobuf prefix + data, one join copy)": lambda: [encode_upload(c) for c in chunks],
        "client: zlib.crc32 of the chunk data (Session._upload_messages)": crc,
        "either side: one memcpy of every encoded chunk (what a byte copy costs here)": memcpy,
        "server: decode_upload (zero-copy view)": lambda: [decode_upload(e) for e in encoded],
        "server: TransferChecker.check (incl. zlib.crc32)": check,
        "server: UploadFold.add, whole (multiply to float64, finite sum, spill write, += into the sum)": fold_whole,
        "server: UploadFold.add part: np.multiply(values, w, dtype=float64)": f_multiply,
        "server: UploadFold.add part: float(contribution.sum()) finite check": f_sum,
        "server: UploadFold.add part: spill.write(chunk) to an unlinked temp file": f_spill,
        "server: UploadFold.add part: sums[...] += contribution": f_add,
    }
    out: dict[str, Any] = {"model_bytes": nbytes, "chunks": len(chunks), "repeat": repeat, "note": "best of `repeat`, one thread, in the benchmark's parent process; MBps = model bytes / seconds", "steps": {}}
    for name, fn in steps.items():
        s = best(fn)
        out["steps"][name] = {"seconds_per_model": round(s, 4), "MBps": round(nbytes / s / MB, 1)}
    f_mean()
    out["steps"]["server: Accumulator.mean (once per round, not per upload)"] = {"seconds_per_model": round(f_mean.t, 4), "MBps": round(nbytes / f_mean.t / MB, 1)}  # type: ignore[attr-defined]
    server_steps = [k for k in out["steps"] if k.startswith("server: ") and "part:" not in k and "mean" not in k]
    client_steps = [k for k in out["steps"] if k.startswith("client: ")]
    srv = sum(out["steps"][k]["seconds_per_model"] for k in server_steps)
    cli = sum(out["steps"][k]["seconds_per_model"] for k in client_steps)
    out["server_python_side_seconds_per_upload"] = round(srv, 4)
    out["server_python_side_ceiling_MBps"] = round(nbytes / srv / MB, 1)
    out["client_python_side_seconds_per_upload"] = round(cli, 4)
    out["client_python_side_ceiling_MBps"] = round(nbytes / cli / MB, 1)
    return out


# --------------------------------------------------------------------------- main
def machine_info() -> dict[str, Any]:
    import grpc
    import numpy
    import torch
    from google import protobuf

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = proc_meminfo_total()
    return {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "mem_total_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "protobuf": protobuf.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }


def proc_meminfo_total() -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tcp-bytes", type=int, default=1 << 30, help="bytes per raw TCP trial (default 1 GiB)")
    ap.add_argument("--tcp-trials", type=int, default=3, help="raw TCP trials before and again after the gRPC phases")
    ap.add_argument("--single-uploads", type=int, default=5, help="measured single-client uploads (one per round)")
    ap.add_argument("--concurrent", type=int, default=10)
    ap.add_argument("--concurrent-rounds", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the server output folders")
    a = ap.parse_args(argv)

    t_start = time.monotonic()
    ctx = mp.get_context("spawn")
    workdir = Path(tempfile.mkdtemp(prefix="wafl-bench-transport-"))
    phases: list[Phase] = []
    procs: list[Any] = []
    pool: Pool | None = None

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    result: dict[str, Any] = {"benchmark": "transport", "started_unix": round(time.time(), 1), "MB": "10^6 bytes", "targets": TARGETS}
    try:
        result["machine"] = machine_info()
        result["loadavg"] = {"start": loadavg()}
        log(f"machine: {result['machine']['nproc']} CPUs, load {result['loadavg']['start']}, python {result['machine']['python']}, grpc {result['machine']['grpc']}, torch {result['machine']['torch']}")

        size = max(a.concurrent + 1, 5)
        log(f"starting {size} client processes (spawn; imports torch and wafl once each)")
        pool = Pool(ctx, size, concurrent_gate_names(a.concurrent_rounds))
        pool.wait_imported()
        result["loadavg"]["after_client_start"] = loadavg()
        time.sleep(2.0)

        log(f"raw TCP loopback: {a.tcp_trials} x {a.tcp_bytes / MB:.0f} MB in 1 MiB sendall/recv_into")
        tcp_before = raw_tcp(ctx, procs, a.tcp_bytes, 1 << 20, a.tcp_trials)
        log(f"  {[t['MBps'] for t in tcp_before]} MB/s")

        log(f"single client: {a.single_uploads} uploads (+1 under cProfile)")
        result["loadavg"]["before_single"] = loadavg()
        single = phase_single(pool, workdir, phases, a.single_uploads)
        log(f"  {[u['MBps'] for u in single['uploads']]} MB/s; model {single['model']['model_bytes']} bytes, {single['model']['params']} parameters")

        log(f"{a.concurrent} concurrent clients (+1 holdout), {a.concurrent_rounds} rounds")
        result["loadavg"]["before_concurrent"] = loadavg()
        conc = phase_concurrent(pool, workdir, phases, a.concurrent, a.concurrent_rounds)
        for pr in conc["rounds"]:
            log(f"  round {pr['round']}: per-client median {pr['per_client_median_MBps']} min {pr['per_client_min_MBps']} aggregate {pr['aggregate_MBps']} MB/s; RSS idle {pr['rss']['idle_VmRSS'] / MB:.0f} MB peak {pr['rss']['peak_VmHWM'] / MB:.0f} MB (+{pr['rss']['peak_minus_idle_model_multiples']} x model)")

        log("no-op round: 5 clients, 3 rounds")
        result["loadavg"]["before_noop"] = loadavg()
        noop = phase_noop(pool, workdir, phases, 5, 3, 2)
        for r in noop["rounds"]:
            log(f"  round {r['round']}: server round_s {r['server_round_s']}, client-observed {r['first_header_to_last_next_broadcast_s']} s")

        log("raw TCP loopback again")
        result["loadavg"]["before_tcp_after"] = loadavg()
        tcp_after = raw_tcp(ctx, procs, a.tcp_bytes, 1 << 20, a.tcp_trials)
        log(f"  {[t['MBps'] for t in tcp_after]} MB/s")

        log("stage costs of the chunk path (in-process)")
        stages = stage_costs()
        result["loadavg"]["end"] = loadavg()

        tcp_all = [t["MBps"] for t in tcp_before + tcp_after]
        tcp_median = statistics.median(tcp_all)
        result["raw_tcp"] = {"bytes_per_trial": a.tcp_bytes, "io_size": 1 << 20, "before": tcp_before, "after": tcp_after, "median_MBps": round(tcp_median, 1)}
        single["ratio_to_raw_tcp"] = round(single["median_MBps"] / tcp_median, 4)
        result["model"] = single["model"]
        result["single_client"] = single
        result["concurrent"] = conc
        result["noop_round"] = noop
        result["stage_costs"] = stages

        model_bytes = single["model"]["model_bytes"]
        rss = conc["rss_worst_round"]
        checks = {
            "single_upload_at_least_20pct_of_raw_tcp": {
                "measured_ratio": single["ratio_to_raw_tcp"],
                "single_upload_MBps": single["median_MBps"],
                "raw_tcp_MBps": round(tcp_median, 1),
                "target": f">= {TARGETS['single_upload_vs_raw_tcp_min_ratio']}",
                "pass": single["ratio_to_raw_tcp"] >= TARGETS["single_upload_vs_raw_tcp_min_ratio"],
            },
            "concurrent_peak_rss_within_idle_plus_4x_model": {
                "idle_VmRSS": rss["idle_VmRSS"],
                "peak_VmHWM": rss["peak_VmHWM"],
                "limit": rss["idle_VmRSS"] + int(TARGETS["concurrent_peak_rss_growth_max_model_multiples"] * model_bytes),
                "measured_model_multiples": rss["peak_minus_idle_model_multiples"],
                "target": f"<= {TARGETS['concurrent_peak_rss_growth_max_model_multiples']}",
                "pass": rss["peak_minus_idle_model_multiples"] <= TARGETS["concurrent_peak_rss_growth_max_model_multiples"],
            },
            "noop_round_under_2s": {
                "client_observed_s": noop["client_observed_s"],
                "server_round_s": noop["server_round_s"],
                "target": f"< {TARGETS['noop_round_max_s']} (both)",
                "pass": max(noop["client_observed_s"], noop["server_round_s"] or 0.0) < TARGETS["noop_round_max_s"],
            },
        }
        result["checks"] = checks
        result["all_pass"] = all(c["pass"] for c in checks.values()) and single["all_bytes_acknowledged"] and conc["all_bytes_acknowledged"]
        result["wall_s"] = round(time.monotonic() - t_start, 1)

        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print_summary(result)
        log(f"wrote {a.out} ({result['wall_s']} s)")
        return 0 if result["all_pass"] else 1
    finally:
        for ph in phases:
            try:
                ph.close()
            except Exception as e:  # keep cleaning up the others
                log(f"cleanup of {ph.name}: {e}")
        if pool is not None:
            pool.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        if a.keep:
            log(f"server folders kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def print_summary(r: dict[str, Any]) -> None:
    m, s, c, n, t = r["model"], r["single_client"], r["concurrent"], r["noop_round"], r["raw_tcp"]
    ok = lambda b: "PASS" if b else "FAIL"  # noqa: E731
    ch = r["checks"]
    print()
    print(f"model: {m['params']:,} parameters ({m['float32_params']:,} float32), {m['model_bytes'] / MB:.1f} MB in {m['tensors']} tensors")
    print(f"machine: {r['machine']['nproc']} CPUs ({r['machine']['cpu']}), load average {r['loadavg']['start']} -> {r['loadavg']['end']}")
    print(f"raw TCP loopback:            {t['median_MBps']:8.1f} MB/s  (trials {[x['MBps'] for x in t['before'] + t['after']]})")
    print(f"1 client upload:             {s['median_MBps']:8.1f} MB/s  median of {[u['MBps'] for u in s['uploads']]}; {s['ratio_to_raw_tcp'] * 100:.1f}% of raw TCP  [{ok(ch['single_upload_at_least_20pct_of_raw_tcp']['pass'])} >= 20%]")
    print(f"10 concurrent, per client:   {c['per_client_median_MBps']:8.1f} MB/s  median, {c['per_client_min_MBps']:.1f} min")
    print(f"10 concurrent, aggregate:    {c['aggregate_MBps_median']:8.1f} MB/s  (rounds {[pr['aggregate_MBps'] for pr in c['rounds']]})")
    w = c["rss_worst_round"]
    print(f"server RSS, 10 concurrent:   idle {w['idle_VmRSS'] / MB:.0f} MB, peak {w['peak_VmHWM'] / MB:.0f} MB, +{w['peak_minus_idle'] / MB:.0f} MB = {w['peak_minus_idle_model_multiples']:.2f} x model  [{ok(ch['concurrent_peak_rss_within_idle_plus_4x_model']['pass'])} <= 4]")
    print(f"no-op round (5 clients):     client-observed {n['client_observed_s']:.3f} s, server round_s {n['server_round_s']:.3f} s  [{ok(ch['noop_round_under_2s']['pass'])} < 2 s]")
    sc = r["stage_costs"]
    print(f"chunk-path CPU (in-process): server {sc['server_python_side_seconds_per_upload']:.3f} s/upload (ceiling {sc['server_python_side_ceiling_MBps']:.0f} MB/s), client {sc['client_python_side_seconds_per_upload']:.3f} s/upload (ceiling {sc['client_python_side_ceiling_MBps']:.0f} MB/s)")
    print(f"overall: {ok(r['all_pass'])}")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Transport benchmark: model uploads over loopback gRPC against the real ``wafl server``.

Run from the repository root (about 2-5 minutes, most of it starting processes)::

    python benchmarks/transport.py            # writes benchmarks/results/transport.json

Everything runs in one go on this machine, each server and client in its own process:

* raw TCP over 127.0.0.1: a sender and a receiver process, one connection, 1 MiB ``sendall`` /
  ``recv_into``, 1 GiB per trial, three trials before and three after the gRPC phases, and one
  512 MiB trial right before each single-client upload;
* one client uploading the 11.2M-parameter float32 model (``resnet18``, ``code_len`` 32 on
  synthetic CIFAR-10 shapes: 44.8 MB) to a server with ``num_clients=1``, one upload per round:
  the time from the call to ``Session.upload`` to its return (the server acknowledges once every
  chunk is checked and folded into the running sum). The pass/fail ratio is the median over the
  uploads of upload MB/s over the MB/s of the TCP trial run just before it, so that both figures
  see the same machine load;
* ten clients uploading at the same moment (released together by one ``multiprocessing.Event``
  once every one of them holds the round's broadcast), on two fresh servers: per-client MB/s, aggregate MB/s (all
  bytes / first start to last finish), and the server's resident memory: idle ``VmRSS`` right
  before the uploads, then ``VmHWM`` after them (the peak is reset with ``/proc/<pid>/clear_refs``
  = 5 right before). An eleventh joined client holds its own upload back until the peak has been
  read, so the round stays open and the reading covers the ten uploads only, not the
  aggregation, broadcast and evaluation that follow a round's last upload. A server's first
  round is the one that shows its peak (later rounds start from an idle RSS that already holds
  what the first one left behind), hence fresh servers; the worst of them is the figure;
* a no-op round: five clients that upload the model they receive at once; round 2 is timed,
  from the clients' side (first receipt of its broadcast header to the last client holding the
  next broadcast) and by the server's own ``round_s`` in ``results.jsonl``;
* what limits the figures: the server's CPU time per thread during the uploads; a cProfile of
  one client upload; the same tensor messages (159 chunks grouped into 50 messages) through a bare ``grpc.aio``
  stream (plain, and with an awaited thread-pool hand-off per message, the cost one thread hop per message would add;
  wafl's handler instead queues chunks to a fold thread without awaiting); the cost of each step
  of the chunk path measured in-process; and diagnostic runs against a server changed at
  start-up by a ``sitecustomize`` module (product files untouched): ``bdp-probe`` (gRPC's
  per-stream receive windows grown from its bandwidth-delay estimate, gRPC's default) and
  ``server-stage-times`` (the server's own chunk-path functions timed during real uploads).

Benchmark clients use ``wafl.client.session.Session``, the transport real clients use; they do
not train and upload the received global state as is. No run reaches its last round (which
evaluates the model): clients stop at the broadcast after their last measured round and the
server is stopped. MB = 10^6 bytes throughout.
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
NUM_SAMPLES = 100  # declared at Join; the server weighs an upload by its own shard size for the client
# what each upload states: the server refuses more than the client's shard holds (it computes the shards
# itself, and a shard of 11 clients' Dirichlet split can be small); the aggregation weight plays no part here
UPLOAD_SAMPLES = 1
NOOP_CLIENTS = 5
# (module, class or "" for a module function, function, key): what the server-stage-times diagnostic times;
# checked to exist before any server starts (a sitecustomize error would only be printed by the server)
STAGE_WRAPS = [
    ("wafl.server.aggregator", "UploadFold", "add", "UploadFold.add (executor thread)"),
    ("wafl.common.codec", "TransferChecker", "check", "TransferChecker.check (event loop)"),
    ("wafl.server.service", "", "decode_upload", "decode_upload (event loop)"),
    ("wafl.server.aggregator", "Accumulator", "mean", "Accumulator.mean (per round)"),
    ("wafl.server.engine", "RoundEngine", "_encode", "RoundEngine._encode (per round)"),
]

# Diagnostics: extra runs against a server changed in one respect, to attribute what the main
# phases measure. Product files stay as they are: the changes are made at interpreter start by a
# ``sitecustomize`` module that only a diagnostic server's PYTHONPATH sees.
DIAGNOSTICS: dict[str, dict[str, Any]] = {
    "bdp-probe": {
        "kind": "concurrent",
        "what": (
            "server GRPC_OPTIONS with ('grpc.http2.bdp_probe', 1) instead of 0: gRPC grows each stream's "
            "HTTP/2 receive window from its bandwidth-delay estimate (its default)"
        ),
        "env": {"WAFL_BENCH_GRPC_OPTIONS": json.dumps([["grpc.http2.bdp_probe", 1]])},
    },
    "server-stage-times": {
        "kind": "single",
        "what": (
            "single-client uploads against a server whose UploadFold.add, TransferChecker.check, "
            "decode_upload, Accumulator.mean and RoundEngine._encode are wrapped in "
            "time.perf_counter accumulators"
        ),
        "env": {"WAFL_BENCH_STAGE_TIMES": "{dir}/stage_times.json", "WAFL_BENCH_STAGE_WRAPS": json.dumps(STAGE_WRAPS)},
    },
    "malloc-fixed-mmap-threshold": {
        "kind": "concurrent",
        "what": (
            "server run with MALLOC_MMAP_THRESHOLD_=131072: glibc keeps a fixed mmap threshold, so freed "
            "buffers of 128 KiB and more go back to the OS at once (tells allocator retention from live memory)"
        ),
        "env": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    },
}
DEFAULT_DIAGNOSTICS = "bdp-probe,server-stage-times"
STAGE_TIMED_UPLOADS = 3
SITECUSTOMIZE = """import json, os
_opts = os.environ.get("WAFL_BENCH_GRPC_OPTIONS")
if _opts:
    import wafl.server.app as _app
    _new = [tuple(kv) for kv in json.loads(_opts)]
    _app.GRPC_OPTIONS[:] = [o for o in _app.GRPC_OPTIONS if o[0] not in {k for k, _ in _new}] + _new
_out = os.environ.get("WAFL_BENCH_STAGE_TIMES")
if _out:
    import importlib, signal, threading, time
    _stats, _lock, _seq = {}, threading.Lock(), [0]

    def _wrap(owner, name, key):
        f = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                with _lock:
                    c = _stats.setdefault(key, [0, 0.0])
                    c[0] += 1
                    c[1] += dt

        setattr(owner, name, timed)

    for _mod, _cls, _name, _key in json.loads(os.environ["WAFL_BENCH_STAGE_WRAPS"]):
        _owner = importlib.import_module(_mod)
        _wrap(getattr(_owner, _cls) if _cls else _owner, _name, _key)

    def _dump(*_):
        with _lock:
            _seq[0] += 1
            data = {"seq": _seq[0], "stats": {k: list(v) for k, v in _stats.items()}}
        with open(_out + ".tmp", "w") as fh:
            json.dump(data, fh)
        os.replace(_out + ".tmp", _out)

    signal.signal(signal.SIGUSR1, _dump)
"""


def check_stage_wraps() -> None:
    """Raises SystemExit naming any function of :data:`STAGE_WRAPS` that the code no longer has."""
    import importlib

    missing = []
    for mod, cls, name, _ in STAGE_WRAPS:
        owner: Any = importlib.import_module(mod)
        if cls:
            owner = getattr(owner, cls, None)
        if owner is None or not callable(getattr(owner, name, None)):
            missing.append(f"{mod}.{cls + '.' if cls else ''}{name}")
    if missing:
        raise SystemExit(f"server-stage-times: the server no longer has {missing}; update STAGE_WRAPS")


NOOP_TIMED_ROUND = 2  # not the run's last round (that one also evaluates the model)

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
    "join_timeout_s": 1800,  # every server starts up front, the last one waits for its phase
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
        if line.startswith(("Vm", "Rss")) and line.endswith("kB"):
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


def _die_with_parent() -> None:
    """In a child about to exec: receive SIGTERM if the benchmark process dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _orphan_watchdog() -> None:
    """In a spawned child: exit at once (skipping interpreter teardown) if the benchmark dies."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="orphan-watchdog").start()


def _get_or_orphaned(q: Any, parent: int) -> Any:
    """``q.get()`` that gives up (returns None) once the process that started us is gone."""
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return None


# --------------------------------------------------------------------------- raw TCP
def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        part = conn.recv(n - len(out))
        if not part:
            return out
        out += part
    return out


def _tcp_receiver(port_q: Any, bufsize: int) -> None:
    """Receives trials on one connection: an 8-byte length, that many bytes, then an 8-byte ack."""
    _orphan_watchdog()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = memoryview(bytearray(bufsize))
    while True:
        head = _recv_exact(conn, 8)
        total = int.from_bytes(head, "little") if len(head) == 8 else 0
        if total == 0:
            break
        got = 0
        while got < total:
            n = conn.recv_into(buf, min(bufsize, total - got))
            if n == 0:
                return
            got += n
        conn.sendall(got.to_bytes(8, "little"))
    conn.close()
    srv.close()


def _tcp_sender(port: int, bufsize: int, cmd_q: Any, result_q: Any) -> None:
    _orphan_watchdog()
    parent = os.getppid()
    payload = os.urandom(bufsize)
    s = socket.create_connection(("127.0.0.1", port))
    while True:
        total = _get_or_orphaned(cmd_q, parent)
        if total is None:
            s.sendall((0).to_bytes(8, "little"))
            break
        t0 = time.perf_counter()
        s.sendall(total.to_bytes(8, "little"))
        sent = 0
        while sent < total:
            s.sendall(payload)
            sent += len(payload)
        ack = _recv_exact(s, 8)
        t1 = time.perf_counter()
        result_q.put((int.from_bytes(ack, "little") if len(ack) == 8 else -1, t1 - t0))
    s.close()


class TcpPair:
    """A sender and a receiver process over 127.0.0.1 (1 MiB ``sendall`` / ``recv_into``)."""

    def __init__(self, ctx: Any, bufsize: int = 1 << 20) -> None:
        self.bufsize = bufsize
        port_q, self.cmd_q, self.result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.rx = ctx.Process(target=_tcp_receiver, args=(port_q, bufsize), daemon=True, name="bench-tcp-receiver")
        self.rx.start()
        port = port_q.get(timeout=120)
        self.tx = ctx.Process(
            target=_tcp_sender, args=(port, bufsize, self.cmd_q, self.result_q), daemon=True, name="bench-tcp-sender"
        )
        self.tx.start()

    def trial(self, nbytes: int) -> dict[str, float]:
        total = -(-nbytes // self.bufsize) * self.bufsize  # whole buffers
        self.cmd_q.put(total)
        got, secs = self.result_q.get(timeout=300)
        if got != total:
            raise RuntimeError(f"raw TCP: the receiver counted {got} of {total} bytes")
        return {
            "bytes": total,
            "seconds": round(secs, 4),
            "MBps": round(total / secs / MB, 1),
            "t": round(time.monotonic(), 3),
        }

    def close(self) -> None:
        if self.tx.is_alive():
            self.cmd_q.put(None)
        for p in (self.tx, self.rx):
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)


# --------------------------------------------------------------------------- gRPC alone
def _grpc_raw_server(port_q: Any, hop: bool, limit: int) -> None:
    """A bare grpc.aio server: one stream-unary method taking raw bytes (no deserializer), summing
    their lengths; with ``hop`` it also hands every message to a thread pool and awaits it (what
    one awaited thread hop per message costs)."""
    _orphan_watchdog()
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    async def serve() -> None:
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        )
        pool = ThreadPoolExecutor(max_workers=4)

        async def upload(requests: Any, ctx: Any) -> bytes:
            loop = asyncio.get_running_loop()
            n = 0
            async for m in requests:
                n += len(m)
                if hop:
                    await loop.run_in_executor(pool, len, m)
            return n.to_bytes(8, "little")

        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "bench.Raw", {"Upload": grpc.stream_unary_rpc_method_handler(upload)}
                )
            ]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await server.wait_for_termination()

    asyncio.run(serve())


def _grpc_raw_client(port: int, sizes: list[int], reps: int, limit: int, result_q: Any) -> None:
    _orphan_watchdog()
    import grpc

    async def run() -> list[float]:
        ch = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        call = ch.stream_unary("/bench.Raw/Upload")
        blob = os.urandom(max(sizes))
        msgs = [blob[:n] for n in sizes]

        async def gen() -> Any:
            for m in msgs:
                yield m

        times = []
        for _ in range(reps + 1):  # the first one warms the connection up
            t0 = time.monotonic()
            reply = await call(gen())
            times.append(time.monotonic() - t0)
            assert int.from_bytes(reply, "little") == sum(sizes)
        await ch.close()
        return times[1:]

    result_q.put(asyncio.run(run()))


def grpc_alone(ctx: Any, sizes: list[int], reps: int) -> dict[str, Any]:
    """The same stream of messages as one wafl upload, through bare grpc.aio (bytes in, bytes out)."""
    from wafl.server.app import MESSAGE_LIMIT

    out: dict[str, Any] = {"messages": len(sizes), "bytes": sum(sizes), "reps": reps}
    for name, hop in (("plain", False), ("executor_hop_per_message", True)):
        port_q, result_q = ctx.Queue(), ctx.Queue()
        srv = ctx.Process(
            target=_grpc_raw_server,
            args=(port_q, hop, MESSAGE_LIMIT),
            daemon=True,
            name=f"bench-grpc-raw-server-{name}",
        )
        srv.start()
        try:
            port = port_q.get(timeout=120)
            cli = ctx.Process(
                target=_grpc_raw_client,
                args=(port, sizes, reps, MESSAGE_LIMIT, result_q),
                daemon=True,
                name=f"bench-grpc-raw-client-{name}",
            )
            cli.start()
            times = result_q.get(timeout=300)
            cli.join(10)
        finally:
            srv.terminate()
            srv.join(5)
        rates = [sum(sizes) / t / MB for t in times]
        out[name] = {"MBps": [round(x, 1) for x in rates], "median_MBps": round(statistics.median(rates), 1)}
    return out


def upload_message_sizes() -> list[int]:
    """Sizes of the chunk messages of one upload of the benchmark's model (as encoded by wafl)."""
    import torch
    from wafl.common.codec import iter_chunks
    from wafl.common.models import build_model
    from wafl.common.wire import encode_upload, group_chunks

    torch.manual_seed(0)
    state = build_model("resnet18", 10, 3, 32, 32).state_dict()
    return [len(encode_upload(m)) for m in group_chunks(iter_chunks(state.items()))]


# --------------------------------------------------------------------------- benchmark client
def _worker(slot: int, cmd_q: Any, msg_q: Any, gates: dict[str, Any]) -> None:
    """A client process, started once and reused by every phase (torch imports once per process).

    Each task is one client of one run: ``{"phase", "address", "index", "gates": {round: gate
    name}, "last_round", "server_pid", "profile_rounds", "rss_probe", "log_file"}``.
    """
    _orphan_watchdog()
    import torch
    import wafl.client.session  # noqa: F401  (warm imports before the first measurement)

    parent = os.getppid()
    torch.set_num_threads(1)
    msg_q.put(("imported", slot))
    while True:
        task = _get_or_orphaned(cmd_q, parent)
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
    from wafl.common.wire import ChunkBatch, decode_broadcast

    phase, index, server_pid = task["phase"], task["index"], task["server_pid"]
    configure_logging(f"bench-client-{index}", task["log_file"], level="WARNING", console=False)
    session = Session(task["address"], f"client-{index}", index, NUM_SAMPLES, reconnect_s=60.0)
    await session.join()
    model_bytes = sum(s.nbytes for s in session.manifest)
    params = sum(s.numel for s in session.manifest)
    float32_params = sum(s.numel for s in session.manifest if s.dtype == pb.FLOAT32)

    # Time-stamp each broadcast header as the client reads it (same decoder, same stream).
    header_t: dict[int, float] = {}

    def timed_decode(raw: bytes) -> Any:
        m = decode_broadcast(raw)
        if not isinstance(m, (RawChunk, ChunkBatch)) and m.WhichOneof("kind") == "header":
            header_t[m.header.round] = time.monotonic()
        return m

    assert session._channel is not None  # opened by join()
    session._broadcasts = session._channel.unary_stream(
        "/wafl.v1.Federation/Broadcasts",
        request_serializer=pb.BroadcastRequest.SerializeToString,
        response_deserializer=timed_decode,
    )

    loop = asyncio.get_running_loop()
    records: list[dict[str, Any]] = []
    try:
        async for model in session.models():
            t_model = time.monotonic()
            rec: dict[str, Any] = {
                "round": model.round,
                "t_header": header_t.get(model.round),
                "t_model": t_model,
                "final": model.final,
            }
            records.append(rec)
            if model.final:
                await session.report(model.round - 1, {"final": 1.0})
                break
            if model.round > task["last_round"]:
                break
            if not model.train:
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
            rss0 = None
            if task.get("rss_probe"):  # only where this client is the server's only uploader
                Path(f"/proc/{server_pid}/clear_refs").write_text("5")
                rss0 = proc_status(server_pid)
            srv0 = thread_cpu(server_pid)
            cpu0 = time.process_time()
            if prof is not None:
                prof.enable()
            t0 = time.monotonic()
            n = await session.upload(model.round, model.state, UPLOAD_SAMPLES, {})
            t1 = time.monotonic()
            if prof is not None:
                prof.disable()
            cpu1 = time.process_time()
            srv1 = thread_cpu(server_pid)
            if rss0 is not None:
                rss1 = proc_status(server_pid)
                rec["server_rss"] = {
                    "idle_VmRSS": rss0["VmRSS"],
                    "peak_VmHWM": rss1["VmHWM"],
                    "peak_minus_idle": rss1["VmHWM"] - rss0["VmRSS"],
                    "peak_minus_idle_model_multiples": round((rss1["VmHWM"] - rss0["VmRSS"]) / model_bytes, 3),
                }
            rec.update(
                t_up_start=t0,
                t_up_end=t1,
                bytes=n,
                client_cpu_s=round(cpu1 - cpu0, 3),
                server_cpu=cpu_delta(server_pid, srv0, srv1),
                profiled=prof is not None,
            )
            if prof is not None:
                rec["profile_top"] = _profile_top(prof, 14)
            msg_q.put((phase, "uploaded", index, model.round, t0, t1, n))
    finally:
        await session.close()
    msg_q.put(
        (
            phase,
            "done",
            index,
            {
                "records": records,
                "model_bytes": model_bytes,
                "params": params,
                "float32_params": float32_params,
                "tensors": len(session.manifest),
            },
        )
    )


def _profile_top(prof: Any, n: int) -> list[dict[str, Any]]:
    import pstats

    st = pstats.Stats(prof)
    total = st.total_tt or 1e-9  # type: ignore[attr-defined]
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({fn})",
                "calls": nc,
                "tottime_s": round(tt, 4),
                "cumtime_s": round(ct, 4),
                "tottime_share": round(tt / total, 3),
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    return [{"profiled_s": round(total, 4)}] + rows[:n]


class Pool:
    """``size`` client processes (spawned, so each has its own interpreter and GIL)."""

    def __init__(self, ctx: Any, size: int, gate_names: list[str]) -> None:
        self.ctx = ctx
        self.msg_q = ctx.Queue()
        self.gates = {name: ctx.Event() for name in gate_names}
        self.cmd_qs = [ctx.Queue() for _ in range(size)]
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(i, self.cmd_qs[i], self.msg_q, self.gates),
                daemon=True,
                name=f"bench-client-worker-{i}",
            )
            for i in range(size)
        ]
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
                    raise RuntimeError(f"client worker(s) died while importing: {dead}") from None
                if time.monotonic() > end:
                    raise TimeoutError("client workers did not start") from None
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
        end = time.monotonic() + 3.0
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:  # results are in; a worker still tearing torch down is just stopped
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


# --------------------------------------------------------------------------- server
class Server:
    def __init__(self, workdir: Path, name: str, env: dict[str, str] | None = None, **cfg: Any) -> None:
        self.name = name
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        self.cfg = {**SERVER_BASE_CONFIG, **cfg}
        cfg_path = self.dir / "config.in.json"
        cfg_path.write_text(json.dumps(self.cfg))
        self.ready = self.dir / "server.json"
        self.console = open(self.dir / "console.txt", "wb")
        cmd = [
            sys.executable,
            "-m",
            "wafl.cli.main",
            "server",
            "--config",
            str(cfg_path),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--out",
            str(self.dir),
            "--ready-file",
            str(self.ready),
            "--quiet",
            "--threads",
            "1",
        ]
        self.env = env or {}
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=self.console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **self.env},
            preexec_fn=_die_with_parent,
        )
        self.pid = self.proc.pid
        self.port = 0

    def wait_ready(self, timeout: float = 120.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before listening:\n{self.console_text()}"
                )
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


# --------------------------------------------------------------------------- stage costs
def stage_costs(repeat: int = 3) -> dict[str, Any]:
    """Per-MB cost of each step of the chunk path, on the benchmark's own model, in this process."""
    import numpy as np
    import torch
    from wafl.client.session import ModelAssembler
    from wafl.common.checksum import IMPLEMENTATION, crc32
    from wafl.common.codec import TransferChecker, iter_chunks, manifest_of, numpy_view
    from wafl.common.models import build_model
    from wafl.common.proto import federation_pb2 as pb
    from wafl.common.wire import (
        PreEncoded,
        chunks_of,
        decode_broadcast,
        decode_upload,
        encode_tensors,
        encode_upload,
        group_chunks,
        write_transfer,
    )
    from wafl.server.aggregator import Accumulator

    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = {k: v.detach().clone().contiguous() for k, v in build_model("resnet18", 10, 3, 32, 32).state_dict().items()}
    manifest = manifest_of(state)
    nbytes = sum(s.nbytes for s in manifest)
    chunks = list(iter_chunks(state.items()))
    messages = list(group_chunks(chunks))
    encoded = [encode_upload(m) for m in messages]
    spec_by_name = {s.name: s for s in manifest}

    def best(fn) -> float:  # type: ignore[no-untyped-def]
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def memcpy() -> None:
        dst = bytearray((1 << 20) + (64 << 10))
        for e in encoded:
            memoryview(dst)[: len(e)] = e

    def crc() -> None:
        c = 0
        for ch in chunks:
            c = crc32(ch.data, c)

    decoded = [c for e in encoded for c in chunks_of(decode_upload(e))]

    def check() -> None:
        ck = TransferChecker(manifest, require_finite=False, compute_crc=False)
        for d in decoded:
            ck.check(d)

    def fold_fresh() -> None:  # a server's first round also faults in the float64 sums
        acc = Accumulator(manifest)
        fold = acc.begin(float(NUM_SAMPLES))
        for d in decoded:
            fold.add(spec_by_name[d.name], d)
        fold.commit()

    warm = Accumulator(manifest)
    warm.reset()  # as the server does before every round: the pages below are resident

    def fold_warm() -> None:
        fold = warm.begin(float(NUM_SAMPLES))
        for d in decoded:
            fold.add(spec_by_name[d.name], d)
        fold.commit()

    fold_warm()  # the spill file in the pool now holds its pages, as after a server's first upload
    views = [(spec_by_name[d.name], d, numpy_view(d.data, spec_by_name[d.name].dtype)) for d in decoded]
    scratch = np.empty(max(v.size for _, _, v in views), dtype=np.float64)
    contribs = [np.multiply(v, 100.0, dtype=np.float64) for _, _, v in views]

    def f_multiply() -> None:
        for _, _, v in views:
            np.multiply(v, 100.0, out=scratch[: v.size], dtype=np.float64)

    def f_sum() -> None:
        for c in contribs:
            float(np.add.reduce(c))

    spill = warm.spills.acquire()

    def f_spill() -> None:
        spill.seek(0)
        for _, d, _ in views:
            spill.write(d.data)

    def f_add() -> None:
        for (spec, d, v), c in zip(views, contribs):
            start = d.offset // v.itemsize
            target = warm.sums[spec.name][start : start + v.size]
            np.add(target, c, out=target)

    warm.total_weight, warm.count = float(NUM_SAMPLES), 1

    def encode_broadcast() -> None:  # RoundEngine._encode: write_transfer, chunk messages encoded once
        [
            m if isinstance(m, pb.BroadcastMessage) else PreEncoded(encode_tensors(m))
            for m in write_transfer(pb.BroadcastMessage, state.items())
        ]

    bc_encoded = [
        m.SerializeToString() if isinstance(m, pb.BroadcastMessage) else encode_tensors(m)
        for m in write_transfer(pb.BroadcastMessage, state.items())
    ]
    header = pb.BroadcastMessage(header=pb.BroadcastHeader(round=1, num_tensors=len(manifest), total_bytes=nbytes))

    def assemble() -> None:  # what Session.models() does with one broadcast
        asm = ModelAssembler(manifest)
        asm.feed(header)
        for e in bc_encoded:
            asm.feed(decode_broadcast(e))

    per_upload = {
        "client: group_chunks + encode_upload (protobuf prefixes + data, one join copy per message)": lambda: [
            encode_upload(m) for m in group_chunks(chunks)
        ],
        f"client: CRC-32 ({IMPLEMENTATION}) of the chunk data (wire.write_transfer)": crc,
        "server: decode_upload (zero-copy views)": lambda: [decode_upload(e) for e in encoded],
        "server: TransferChecker.check": check,
        f"server: CRC-32 ({IMPLEMENTATION}) in the fold thread (FoldPipeline)": crc,
        "server: UploadFold.add, later rounds (sums and spill file resident)": fold_warm,
        "server: UploadFold.add, a server's first round (faults in the float64 sums)": fold_fresh,
        "server: UploadFold.add part: np.multiply(values, w) into the float64 scratch": f_multiply,
        "server: UploadFold.add part: np.add.reduce(contribution) finite check": f_sum,
        "server: UploadFold.add part: spill.write(chunk) to a pooled temp file": f_spill,
        "server: UploadFold.add part: np.add(sums, contribution) in place": f_add,
        "reference: one memcpy of every encoded message": memcpy,
    }
    per_round = {
        "server: Accumulator.mean": warm.mean,
        "server: encode the broadcast (write_transfer + encode_tensors, RoundEngine._encode)": encode_broadcast,
        "client: receive one broadcast (decode + ModelAssembler.feed: check, CRC, copy, tensors)": assemble,
    }
    out: dict[str, Any] = {
        "model_bytes": nbytes,
        "chunks": len(chunks),
        "messages": len(messages),
        "repeat": repeat,
        "note": (
            "best of `repeat`, one thread, in the benchmark's parent process after the other phases; MBps "
            "= model bytes / seconds"
        ),
        "per_upload": {},
        "per_round": {},
    }
    for group, steps in (("per_upload", per_upload), ("per_round", per_round)):
        for name, fn in steps.items():
            sec = best(fn)
            out[group][name] = {"seconds_per_model": round(sec, 4), "MBps": round(nbytes / sec / MB, 1)}
    up = out["per_upload"]
    srv = sum(
        v["seconds_per_model"]
        for k, v in up.items()
        if k.startswith("server: ") and "part:" not in k and "first round" not in k
    )
    cli = sum(v["seconds_per_model"] for k, v in up.items() if k.startswith("client: "))
    out["server_seconds_per_upload"] = round(srv, 4)
    out["server_ceiling_MBps"] = round(nbytes / srv / MB, 1)
    out["client_seconds_per_upload"] = round(cli, 4)
    out["client_ceiling_MBps"] = round(nbytes / cli / MB, 1)
    out["ceiling_note"] = (
        "the Python-side work one upload costs (decode + check + CRC + warm fold on the server; grouping, "
        "encoding + CRC on the client), gRPC's own work excluded"
    )
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
    ap.add_argument(
        "--tcp-paired-bytes",
        type=int,
        default=1 << 29,
        help="bytes of the raw TCP trial run right before each single-client upload (default 512 MiB)",
    )
    ap.add_argument("--single-uploads", type=int, default=9, help="measured single-client uploads (one per round)")
    ap.add_argument("--concurrent", type=int, default=10)
    ap.add_argument(
        "--concurrent-runs",
        type=int,
        default=2,
        help="fresh servers for the concurrent uploads (the first round of a server is the one that shows its peak)",
    )
    ap.add_argument("--concurrent-rounds", type=int, default=1, help="rounds of concurrent uploads per server")
    ap.add_argument("--keep", action="store_true", help="keep the server output folders")
    ap.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when a target is missed (default: 0 once the measurements are written)",
    )
    ap.add_argument(
        "--diagnostics",
        default=DEFAULT_DIAGNOSTICS,
        help=(
            "comma-separated extra runs against a server modified at start-up (product files untouched), "
            f"from {sorted(DIAGNOSTICS)}, or 'none' (default: {DEFAULT_DIAGNOSTICS})"
        ),
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="every phase at a tiny size (20 MB TCP trials, 1 upload, 2 concurrent clients, one fresh server, the "
        "server-stage-times diagnostic): checks the script, not the machine; JSON to --out (default: a smoke file)",
    )
    a = ap.parse_args(argv)
    if a.smoke:
        a.tcp_bytes, a.tcp_trials, a.tcp_paired_bytes = 20_000_000, 1, 10_000_000
        a.single_uploads, a.concurrent, a.concurrent_runs, a.concurrent_rounds = 1, 2, 1, 1
        a.diagnostics = "server-stage-times"
        if a.out == RESULTS:
            a.out = RESULTS.with_name("transport-smoke.json")
    if "server-stage-times" in a.diagnostics.split(","):
        check_stage_wraps()

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
        from wafl.cli.bench import git_commit

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

        model_bytes = single["model"]["model_bytes"]
        rss = conc["rss_worst_round"]
        checks = {
            "single_upload_at_least_20pct_of_raw_tcp": {
                "measured_ratio": single["median_ratio_to_paired_raw_tcp"],
                "basis": "median over the uploads of (upload MB/s / MB/s of the raw TCP trial run right before it)",
                "ratio_median_upload_to_median_raw_tcp": single["ratio_to_raw_tcp_median"],
                "single_upload_MBps_median": single["median_MBps"],
                "raw_tcp_MBps_median": round(tcp_median, 1),
                "target": f">= {TARGETS['single_upload_vs_raw_tcp_min_ratio']}",
                "pass": single["median_ratio_to_paired_raw_tcp"] >= TARGETS["single_upload_vs_raw_tcp_min_ratio"],
            },
            "concurrent_peak_rss_within_idle_plus_4x_model": {
                "idle_VmRSS": rss["idle_VmRSS"],
                "peak_VmHWM": rss["peak_VmHWM"],
                "limit": rss["idle_VmRSS"]
                + int(TARGETS["concurrent_peak_rss_growth_max_model_multiples"] * model_bytes),
                "measured_model_multiples": rss["peak_minus_idle_model_multiples"],
                "target": f"<= {TARGETS['concurrent_peak_rss_growth_max_model_multiples']}",
                "pass": rss["peak_minus_idle_model_multiples"]
                <= TARGETS["concurrent_peak_rss_growth_max_model_multiples"],
            },
            "noop_round_under_2s": {
                "client_observed_s": noop["client_observed_s"],
                "server_round_s": noop["server_round_s"],
                "target": f"< {TARGETS['noop_round_max_s']} (both)",
                "pass": max(noop["client_observed_s"], noop["server_round_s"] or 0.0) < TARGETS["noop_round_max_s"],
            },
        }
        result["checks"] = checks
        result["all_pass"] = (
            all(c["pass"] for c in checks.values())
            and single["all_bytes_acknowledged"]
            and conc["all_bytes_acknowledged"]
        )
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        one_min = [v[0] for k, v in result["loadavg"].items() if k.startswith("before_") or k == "end"]
        result["load_note"] = (
            f"1-minute load average {min(one_min):.1f}..{max(one_min):.1f} during the measurements on "
            f"{result['machine']['nproc']} CPUs: other processes competed for the CPUs, so the figures, raw "
            "TCP included, vary from run to run"
            if max(one_min) > (result["machine"]["nproc"] or 1)
            else "the load average stayed within the CPU count"
        )

        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
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


def print_summary(r: dict[str, Any]) -> None:
    m, s, c, n, t = r["model"], r["single_client"], r["concurrent"], r["noop_round"], r["raw_tcp"]
    ok = lambda b: "PASS" if b else "FAIL"  # noqa: E731
    ch = r["checks"]
    print()
    print(
        f"model: {m['params']:,} parameters ({m['float32_params']:,} float32), {m['model_bytes'] / MB:.1f} MB "
        f"in {m['tensors']} tensors"
    )
    print(
        f"machine: {r['machine']['nproc']} CPUs ({r['machine']['cpu']}), load average {r['loadavg']['start']} "
        f"-> {r['loadavg']['end']}"
    )
    print(f"note: {r['load_note']}")
    print(
        f"raw TCP loopback:            {t['median_MBps']:8.1f} MB/s  median, "
        f"{t['worst_MBps']:.0f}..{t['best_MBps']:.0f} over "
        f"{len(t['before'] + t['paired_with_single_uploads'] + t['after'])} trials"
    )
    print(f"1 client upload:             {s['median_MBps']:8.1f} MB/s  median of {[u['MBps'] for u in s['uploads']]}")
    print(
        f"  upload / raw TCP:          {s['median_ratio_to_paired_raw_tcp'] * 100:8.1f} %     median of "
        "per-upload ratios to the TCP trial just before "
        f"{[round(u['ratio_to_paired_raw_tcp'] * 100, 1) for u in s['uploads']]}  "
        f"[{ok(ch['single_upload_at_least_20pct_of_raw_tcp']['pass'])} >= 20%]"
    )
    print(
        f"                             {s['ratio_to_raw_tcp_median'] * 100:8.1f} %     median upload / median "
        f"TCP; best / best {s['ratio_best_to_best_raw_tcp'] * 100:.1f}%"
    )
    g = r["grpc_alone"]
    print(
        f"same {g['messages']} messages, bare grpc.aio: {g['plain']['median_MBps']:8.1f} MB/s  "
        f"({g['plain']['ratio_to_raw_tcp_median'] * 100:.1f}% of raw TCP); with an executor hop per message "
        f"{g['executor_hop_per_message']['median_MBps']:.1f} MB/s"
    )
    k = c["clients_uploading"]
    print(
        f"{k:2d} concurrent, per client:   {c['per_client_median_MBps']:8.1f} MB/s  median, "
        f"{c['per_client_min_MBps']:.1f} min"
    )
    print(f"{k:2d} concurrent, aggregate:    {c['aggregate_MBps_median']:8.1f} MB/s  median of {c['aggregate_MBps']}")
    w = c["rss_worst_round"]
    print(
        f"server RSS, {k:2d} concurrent:   idle {w['idle_VmRSS'] / MB:.0f} MB, peak {w['peak_VmHWM'] / MB:.0f} "
        f"MB, +{w['peak_minus_idle'] / MB:.0f} MB = {w['peak_minus_idle_model_multiples']:.2f} x model (worst; "
        f"first rounds {c['rss_first_round_model_multiples']})  "
        f"[{ok(ch['concurrent_peak_rss_within_idle_plus_4x_model']['pass'])} <= 4]"
    )
    print(
        f"no-op round (5 clients):     client-observed {n['client_observed_s']:.3f} s, server round_s "
        f"{n['server_round_s']:.3f} s  [{ok(ch['noop_round_under_2s']['pass'])} < 2 s]"
    )
    sc = r["stage_costs"]
    print(
        f"chunk-path CPU (in-process): server {sc['server_seconds_per_upload']:.3f} s/upload (ceiling "
        f"{sc['server_ceiling_MBps']:.0f} MB/s), client {sc['client_seconds_per_upload']:.3f} s/upload "
        f"(ceiling {sc['client_ceiling_MBps']:.0f} MB/s)"
    )
    for d, res in r.get("diagnostics", {}).items():
        if "uploads" in res:
            u = res["uploads"][len(res["uploads"]) // 2]
            print(
                f"  diagnostic {d} (round {u['round']}): upload {u['seconds']} s = "
                + " + ".join(f"{k.split(' ')[0]} {v['seconds']}" for k, v in u["stages"].items())
                + f" + other {u['unaccounted_s']}"
            )
            continue
        print(
            f"  diagnostic {d}: +{res['rss']['peak_minus_idle'] / MB:.0f} MB = "
            f"{res['rss']['peak_minus_idle_model_multiples']:.2f} x model, aggregate "
            f"{res['aggregate_MBps']:.1f} MB/s (first round; compare the round-1 figures above)"
        )
    print(f"overall: {ok(r['all_pass'])}")


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark clients: a pool of spawned worker processes, each running one ``Session`` client per
task (join, then upload every broadcast model at once, timing and profiling what the task asks)."""

from __future__ import annotations

import asyncio
import os
import queue
import time
from pathlib import Path
from typing import Any

from .lifetime import get_or_orphaned, orphan_watchdog
from .procfs import cpu_delta, proc_status, thread_cpu

NUM_SAMPLES = 100  # declared at Join; the server weighs an upload by its own shard size for the client
# what each upload states: the server refuses more than the client's shard holds (it computes the shards
# itself, and a shard of 11 clients' Dirichlet split can be small); the aggregation weight plays no part here
UPLOAD_SAMPLES = 1


def _worker(slot: int, cmd_q: Any, msg_q: Any, gates: dict[str, Any]) -> None:
    """A client process, started once and reused by every phase (torch imports once per process).

    Each task is one client of one run: ``{"phase", "address", "index", "gates": {round: gate
    name}, "last_round", "server_pid", "profile_rounds", "rss_probe", "log_file"}``.
    """
    orphan_watchdog()
    import torch
    import wafl.client.session  # noqa: F401  (warm imports before the first measurement)

    parent = os.getppid()
    torch.set_num_threads(1)
    msg_q.put(("imported", slot))
    while True:
        task = get_or_orphaned(cmd_q, parent)
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

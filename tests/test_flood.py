"""Outsiders and a rogue client flood the server while the honest federation runs to its end.

Real processes over real sockets: a server started with a token, three honest ``wafl client``
processes, and, from this process and a client built from the .proto alone, at the same time:
outsiders keeping 48 Upload streams, 48 Join calls, 24 Broadcasts streams and 16 health calls
open and silent (reopened as soon as they end), and a rogue client with its own valid credential
holding 44 Broadcasts streams and 16 silent uploads. The run must finish every round; meanwhile
health checks and Joins of newcomers are answered, and every flooding call gets its status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from independent_client import CREDENTIAL_KEY, IndependentClient, ServerProcess, generate_stubs

pytestmark = pytest.mark.timeout(600)  # a federation of real processes under a flood
TOKEN = "flood-tests-" + uuid.uuid4().hex
ROUNDS = 3
CONFIG = {
    "num_clients": 4,
    "rounds": ROUNDS,
    "min_clients": 3,  # the rogue (index 3) never uploads: rounds close at the deadline with the honest three
    "round_deadline_s": 6,
    "join_timeout_s": 120,
    "local_epochs": 1,
    "eval_every": 0,
    "upload_stall_s": 3,
    "final_report_s": 5,  # the rogue never reports the final model
    "seed": 0,
}


OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]  # channels of one process share no connection


class Flood:
    """Threads that each keep one silent call open, and open another when it ends."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.codes: Counter[tuple[str, str]] = Counter()
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def _silence(self):
        self.stop.wait()
        return
        yield  # a generator that sends nothing until the flood ends

    def keep(self, name: str, open_call) -> None:
        def loop() -> None:
            while not self.stop.is_set():
                try:
                    result = open_call(self._silence())
                    for _ in result if hasattr(result, "__iter__") else ():
                        pass
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                with self.lock:
                    self.codes[(name, code)] += 1
                self.stop.wait(0.5)  # reopened at once, as often as an attacker on a shared machine can

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        self.threads.append(t)

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


def _client(address: str, index: int, state: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WAFL_TOKEN=TOKEN)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wafl.cli.main",
            "client",
            "--server",
            address,
            "--index",
            str(index),
            "--state-dir",
            str(state),
            "--reconnect-s",
            "120",
            "--log-file",
            str(log),
            "--quiet",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env=env,
    )


def test_the_honest_federation_finishes_under_a_flood(tmp_path: Path) -> None:
    pb, pb_grpc = generate_stubs(tmp_path / "stubs")
    server = ServerProcess(CONFIG, tmp_path / "server", extra_args=("--token-file", str(_token_file(tmp_path))))
    flood = Flood()
    channels: list[grpc.Channel] = []
    clients: list[subprocess.Popen] = []
    rogue = IndependentClient(pb, pb_grpc, server.address, "rogue", 3, 10)
    try:

        def channel() -> grpc.Channel:
            ch = grpc.insecure_channel(server.address, options=OWN_CONNECTION)
            channels.append(ch)
            return ch

        # outsiders: no credential at all, many connections
        for i in range(48):
            ch = channel() if i % 8 == 0 else channels[-1]
            upload = ch.stream_unary("/wafl.v1.Federation/Upload")
            flood.keep("outsider-upload", lambda it, f=upload: f(it, timeout=60))
        for i in range(48):
            ch = channel() if i % 8 == 0 else channels[-1]
            join = ch.stream_unary("/wafl.v1.Federation/Join")  # a Join that never sends its request
            flood.keep("outsider-join", lambda it, f=join: f(it, timeout=60))
        for i in range(24):
            ch = channel() if i % 8 == 0 else channels[-1]
            bc = ch.stream_stream("/wafl.v1.Federation/Broadcasts")
            flood.keep("outsider-broadcasts", lambda it, f=bc: f(it, timeout=60))
        for i in range(16):
            ch = channel() if i % 8 == 0 else channels[-1]
            watch = ch.stream_stream("/grpc.health.v1.Health/Watch")
            flood.keep("outsider-health", lambda it, f=watch: f(it, timeout=60))
        # the rogue: a valid credential of its own
        rogue.token = TOKEN
        rogue.reply = rogue.join()
        md = ((CREDENTIAL_KEY, rogue.credential),)
        req = pb.BroadcastRequest(run_id=rogue.reply.run_id, client_id=rogue.client_id)
        for _ in range(44):
            flood.keep("rogue-broadcasts", lambda it: rogue.stub.Broadcasts(req, timeout=60, metadata=md))
        for _ in range(16):
            flood.keep("rogue-upload", lambda it: rogue.stub.Upload(it, timeout=60, metadata=md))
        time.sleep(2.0)  # the flood is on before any honest client arrives

        clients = [_client(server.address, i, tmp_path / f"state{i}", tmp_path / f"c{i}.jsonl") for i in range(3)]
        health = health_pb2_grpc.HealthStub(channel())
        newcomer = pb_grpc.FederationStub(channel())
        served = joined = 0
        while any(c.poll() is None for c in clients) and server.alive():
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                served += reply.status == health_pb2.HealthCheckResponse.SERVING
                # a Join is answered in the flood too (a configuration probe, which registers nothing)
                # (on a connection of its own: the rogue's is full of its own streams)
                probe = pb.JoinRequest(client_id="rogue", protocol_version=1, client_index=3, token=TOKEN)
                joined += newcomer.Join(probe, timeout=5).run_id == rogue.reply.run_id
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e  # cut to make room: clients retry it
            time.sleep(0.5)
        assert [c.wait(timeout=120) for c in clients] == [0, 0, 0], server.log_tail()
        assert served > 0 and joined > 0
        assert server.proc.wait(timeout=120) == 0, server.log_tail()
    finally:
        flood.end()
        for c in clients:
            if c.poll() is None:
                c.kill()
        rogue.close()
        for ch in channels:
            ch.close()
        server.stop()
    rows = [json.loads(line) for line in (server.out_dir / "results.jsonl").read_text().splitlines()]
    assert {r["round"] for r in rows if "gm_accuracy" in r} >= set(range(1, ROUNDS + 1))
    codes = dict(flood.codes)
    assert codes.get(("outsider-upload", "UNAUTHENTICATED"), 0) > 0, codes
    assert codes.get(("outsider-broadcasts", "UNAUTHENTICATED"), 0) > 0, codes
    assert not any(k[1] == "OK" for k in codes if k[0].startswith("outsider")), codes
    # each new rogue stream replaced its older one; its uploads beyond its budget were refused
    assert codes.get(("rogue-broadcasts", "CANCELLED"), 0) > 0, codes
    assert codes.get(("rogue-upload", "RESOURCE_EXHAUSTED"), 0) > 0, codes


def _token_file(tmp_path: Path) -> Path:
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")
    p.chmod(0o600)
    return p

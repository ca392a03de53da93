"""A newer Broadcasts stream of a client replaces the older: of many streams one client opens with its own
credential, over many connections, reading what arrives, every one but the newest ends with ``CANCELLED``.

Before the fix about a third stayed open and idle: the stream's models were yielded to gRPC, whose own
write swallowed the cancellation of a replaced stream's task and never sent its status.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
from independent_client import ServerProcess, join_clients

CONFIG = {
    "num_clients": 2,
    "rounds": 40,
    "round_deadline_s": 90,
    "join_timeout_s": 60,
    "local_epochs": 1,
    "eval_every": 0,
    "checkpoint": False,
    "seed": 0,
}
STREAMS = 300
CONNECTIONS = 20  # the server takes 16 streams at once per connection


def test_every_replaced_broadcasts_stream_ends(stubs, tmp_path: Path) -> None:
    pb, pb_grpc = stubs
    server = ServerProcess(CONFIG, tmp_path / "server")
    channels: list[grpc.Channel] = []
    clients = []
    try:
        clients = join_clients(pb, pb_grpc, server, "replace", (30, 70))
        a = clients[0]
        a.listener.wait(1)
        channels = [
            grpc.insecure_channel(
                server.address,
                options=[("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 8 << 20)],
            )
            for _ in range(CONNECTIONS)
        ]
        req = pb.BroadcastRequest(run_id=a.reply.run_id, client_id=a.client_id)
        calls = []

        def read(call: grpc.Call) -> None:
            try:
                for _ in call:
                    pass
            except grpc.RpcError:
                pass

        for i in range(STREAMS):
            call = pb_grpc.FederationStub(channels[i % CONNECTIONS]).Broadcasts(req, metadata=a.metadata(), timeout=120)
            calls.append(call)
            threading.Thread(target=read, args=(call,), daemon=True).start()
            time.sleep(0.002)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and sum(c.is_active() for c in calls) > 1:
            time.sleep(0.2)
        open_calls = [i for i, c in enumerate(calls) if c.is_active()]
        assert len(open_calls) <= 1, f"{len(open_calls)} of {STREAMS} streams of one client are still open"
        ended = {c.code() for c in calls if not c.is_active()}
        assert ended <= {grpc.StatusCode.CANCELLED}, ended
        assert server.alive(), server.log_tail()
    finally:
        for ch in channels:
            ch.close()
        for c in clients:
            c.close()
        server.stop()
    assert "Traceback" not in server.log_path.read_text(errors="replace"), server.log_tail()

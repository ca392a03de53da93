"""A server killed mid-run and restarted with --resume: clients reconnect and the run completes."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from independent_client import server_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rows(out: Path) -> list[dict]:
    p = out / "results.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def wait_for(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_clients_reconnect_to_a_resumed_server(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"num_clients": 2, "rounds": 6, "local_epochs": 1, "round_deadline_s": 60}))
    port = free_port()
    server_cmd = server_command(cfg, out, port)
    procs = []
    try:
        server = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        procs.append(server)
        clients = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "wafl.cli.main",
                    "client",
                    "--server",
                    f"127.0.0.1:{port}",
                    "--index",
                    str(i),
                    "--reconnect-s",
                    "90",
                    "--log-file",
                    str(tmp_path / f"c{i}.jsonl"),
                    "--quiet",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            for i in range(2)
        ]
        procs += clients
        wait_for(lambda: len(rows(out)) >= 2, 180, "two rounds before the crash")
        server.send_signal(signal.SIGKILL)
        server.wait()
        done_before = json.loads(json.dumps(rows(out)))
        assert all(c.poll() is None for c in clients), "clients must survive the server's death"
        time.sleep(1.0)
        resumed = subprocess.Popen([*server_cmd, "--resume"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        procs.append(resumed)
        assert resumed.wait(timeout=240) == 0, (out / "logs" / "server.jsonl").read_text()[-3000:]
        assert [c.wait(timeout=60) for c in clients] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    final = rows(out)
    assert final[-1]["round"] == 6
    assert {r["round"] for r in final} >= set(range(len(done_before) + 1, 7))
    log = (out / "logs" / "server.jsonl").read_text()
    assert '"event": "resume"' in log
    for i in range(2):
        events = [json.loads(line)["event"] for line in (tmp_path / f"c{i}.jsonl").read_text().splitlines()]
        assert "retry" in events and events.count("joined") >= 3  # probe + join + at least one re-join

"""A server killed with SIGKILL at several points and resumed builds the bit-identical final model
of an uninterrupted run: real processes, deterministic CPU training (one thread, compute-and-wait)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_resilience import free_port, rows, wait_for
from wafl.server.checkpoint import load_checkpoint

CONFIG = {
    "num_clients": 2,
    "rounds": 3,
    "local_epochs": 1,
    "protocol": "compute-and-wait",
    "eval_every": 0,
    "round_deadline_s": 120,
    "seed": 1,
}
pytestmark = pytest.mark.timeout(900)  # several federations of real processes, on a machine it may share
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def digest(out: Path) -> str:
    ck = load_checkpoint(out / "checkpoint.pt")
    assert ck is not None and ck["round"] == CONFIG["rounds"]
    h = hashlib.sha256()
    for k, v in ck["global_state"].items():
        h.update(k.encode())
        h.update(v.contiguous().numpy().tobytes())
    return h.hexdigest()


def accepted(out: Path, round: int) -> int:
    path = out / "logs" / "server.jsonl"
    if not path.exists():
        return 0
    n = 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        n += rec.get("event") == "upload.accepted" and rec.get("round") == round
    return n


def federation(tmp: Path, kill_when: Callable[[Path], bool] | None) -> str:
    out = tmp / "run"
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    port = free_port()
    server_cmd = [sys.executable, "-m", "wafl.cli.main", "server", "--config", str(cfg), "--host", "127.0.0.1"]
    server_cmd += ["--port", str(port), "--out", str(out), "--threads", "1", "--quiet"]
    procs: list[subprocess.Popen] = []
    try:
        server = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=ENV)
        procs.append(server)
        clients = [
            subprocess.Popen(
                [sys.executable, "-m", "wafl.cli.main", "client", "--server", f"127.0.0.1:{port}", "--index", str(i)]
                + ["--device", "cpu", "--threads", "1", "--reconnect-s", "120", "--quiet"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                env=ENV,
            )
            for i in range(CONFIG["num_clients"])
        ]
        procs += clients
        if kill_when is not None:
            wait_for(lambda: kill_when(out) or server.poll() is not None, 300, "the kill point")
            assert server.poll() is None, "the run ended before its kill point"
            server.send_signal(signal.SIGKILL)
            server.wait()
            time.sleep(0.5)
            server = subprocess.Popen(
                [*server_cmd, "--resume"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=ENV
            )
            procs.append(server)
        assert server.wait(timeout=400) == 0, (out / "logs" / "server.jsonl").read_text()[-3000:]
        assert [c.wait(timeout=120) for c in clients] == [0] * CONFIG["num_clients"]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return digest(out)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    return federation(tmp_path_factory.mktemp("uninterrupted"), None)


@pytest.mark.parametrize(
    "kill_when",
    [
        pytest.param(lambda out: len(rows(out)) >= 1, id="after-round-1"),
        pytest.param(lambda out: accepted(out, 2) >= 1, id="mid-round-2"),
        pytest.param(lambda out: accepted(out, 2) >= 2, id="round-2-collected"),
    ],
)
def test_a_killed_and_resumed_run_builds_the_same_model(uninterrupted: str, tmp_path: Path, kill_when) -> None:
    assert federation(tmp_path, kill_when) == uninterrupted

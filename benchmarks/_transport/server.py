"""The ``wafl server`` under test: one process per phase, started up front, read and stopped by the phases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import REPO
from .lifetime import die_with_parent
from .procfs import proc_status

SERVER_BASE_CONFIG = {
    "dataset": "synthetic-cifar10",
    "model": "resnet18",
    "code_len": 32,
    "eval_every": 0,
    "checkpoint": False,
    "round_deadline_s": 300,
    "join_timeout_s": 1800,  # every server starts up front, the last one waits for its phase
}


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
            preexec_fn=die_with_parent,
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

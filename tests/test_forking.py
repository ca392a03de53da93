"""``wafl run``'s default: the clients in worker processes forked from the launcher (``wafl.cli.launch.forking``),
learning exactly what one fresh process per client (``--workers 0``) learns from the same seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wafl.cli.launch import forking
from wafl.cli.main import main


def _run(repo: Path, out: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "wafl.cli.main", "run", "--clients", "3", "--rounds", "2", "--quiet"]
    p = subprocess.run([*cmd, "--out", str(out), *extra], cwd=repo, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr + (out / "logs" / "server.log").read_text()[-2000:]
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _was_forked(out: Path) -> bool:
    """What the run's summary says: its processes were forked from the launcher."""
    return json.loads((out / "summary.json").read_text())["forked"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_default_run_forks_workers_and_learns_what_one_process_per_client_learns(repo: Path, tmp_path: Path) -> None:
    forked = _run(repo, tmp_path / "default")
    alone = _run(repo, tmp_path / "alone", "--workers", "0")
    assert [r["gm_accuracy"] for r in forked] == [r["gm_accuracy"] for r in alone]
    assert _was_forked(tmp_path / "default") and _was_forked(tmp_path / "alone")  # neither started afresh
    assert forked[-1]["gm_accuracy"] > 0.3  # chance is 0.1
    assert [r["clients"] for r in forked] == [3, 3]
    assert sorted(p.name for p in (tmp_path / "default" / "logs").glob("worker-*.jsonl"))  # hosted in workers
    assert not list((tmp_path / "default" / "logs").glob("client-*.jsonl"))
    assert len(list((tmp_path / "alone" / "logs").glob("client-*.jsonl"))) == 3


def test_forked_child_runs_main_with_its_log_and_exit_status(tmp_path: Path) -> None:
    """A child forked here runs the command (no gRPC: safe from a test process): its output lands in its
    log, its exit status comes back through ``poll``/``wait``."""
    log = tmp_path / "child.log"
    child = forking.fork_main(["run", "--rounds", "abc"], log, dict(os.environ), main)
    assert child.wait(timeout=60) == 2  # argparse's usage error
    assert "argument --rounds: invalid int value: 'abc'" in log.read_text()
    assert child.poll() == 2


def test_forked_process_terminates_and_times_out() -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    child = forking.ForkedProcess(pid, ["sleep"])
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    assert child.poll() is None
    child.terminate()
    assert child.wait(timeout=30) == -15  # SIGTERM, as Popen reports it


def test_a_process_with_threads_or_grpc_does_not_fork(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setitem(sys.modules, "grpc", sys.modules.get("grpc") or object())
    assert not forking.can_fork()
    monkeypatch.delitem(sys.modules, "grpc")
    gate = threading.Event()
    t = threading.Thread(target=gate.wait)
    t.start()
    try:
        assert not forking.can_fork()
    finally:
        gate.set()
        t.join()

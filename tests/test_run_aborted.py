"""A server whose run cannot go on ends with exit status 1 and one ``run.aborted`` line that says why, without a
traceback (the reason is the user's to act on, not a failure inside wafl)."""

from __future__ import annotations

from pathlib import Path

import pytest
from independent_client import ServerProcess

pytestmark = pytest.mark.timeout(300)


def test_too_few_clients_joined_aborts_with_the_reason_and_no_traceback(tmp_path: Path) -> None:
    server = ServerProcess({"num_clients": 2, "rounds": 1, "join_timeout_s": 1.0}, tmp_path)
    try:
        assert server.proc.wait(timeout=120) == 1
        (aborted,) = server.events("run.aborted")
        assert aborted["error"] == "only 0 of num_clients=2 joined within join_timeout_s=1.0"
        assert aborted["level"] == "error" and "exception" not in aborted, aborted
        assert "Traceback" not in server.log_tail(20000)
    finally:
        server.stop()


def test_an_aborted_run_ends_the_clients_broadcast_streams_with_its_reason(stubs, tmp_path: Path) -> None:
    """A client waiting for its first model learns that the run was aborted, and why (``ABORTED``), instead of
    losing the connection; the server stops without a call left to cancel."""
    import grpc
    from independent_client import IndependentClient

    pb, pb_grpc = stubs
    server = ServerProcess({"num_clients": 2, "rounds": 1, "join_timeout_s": 5.0}, tmp_path)
    try:
        client = IndependentClient(pb, pb_grpc, server.address, "client-0", 0, 100)
        client.join_and_listen()
        assert server.proc.wait(timeout=120) == 1
        assert client.listener is not None
        client.listener.thread.join(timeout=30)
        error = client.listener.error
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.ABORTED, error
        assert error.details() == "the run was aborted: only 1 of num_clients=2 joined within join_timeout_s=5.0"
        log = server.log_tail(20000)
        assert "Exception not handled" not in log and "CancelledError" not in log, log
    finally:
        server.stop()


def test_a_wafl_client_stops_with_the_servers_reason_when_the_run_is_aborted(tmp_path: Path) -> None:
    """``wafl client`` of a run the server aborts exits with status 1 and one line saying why, instead of
    retrying a server that has ended the run."""
    import subprocess
    import sys
    import time

    from independent_client import server_events

    server = ServerProcess({"num_clients": 2, "rounds": 1, "join_timeout_s": 30.0}, tmp_path / "server")
    client = subprocess.Popen(
        [sys.executable, "-m", "wafl.cli.main", "client", "--server", server.address, "--index", "0", "--quiet",
         "--state-dir", str(tmp_path / "client")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not server_events(server.out_dir, "client.join") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.wait(timeout=120) == 1
        _, err = client.communicate(timeout=60)
        assert client.returncode == 1, err
        reason = "only 1 of num_clients=2 joined within join_timeout_s=30.0"
        assert err.strip().splitlines()[-1] == f"wafl: the server ended the run: the run was aborted: {reason}", err
    finally:
        client.kill()
        server.stop()

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

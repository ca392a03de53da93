"""A client that restarts, or whose Join reply is lost, joins its index again; a live client's index still
cannot be taken over.

Under a run token or an open server a registered index re-joins without its session credential once its
session is not live (``wafl.server.auth.Presence``): never confirmed (the reply that carried the credential
was lost, so the credential was never used) or gone (no Broadcasts stream, no call for ``REJOIN_GRACE_S``).
The new session's credential replaces the old one's. Before, every such Join got ``PERMISSION_DENIED`` for
the rest of the run, and a ``wafl client`` killed with -9 and restarted without ``--state-dir`` died with a
traceback while the federation ran on without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
from independent_client import IndependentClient, ServerProcess, call_error, expect_status
from wafl.server.auth import REJOIN_GRACE_S

TOKEN = "rejoin-tests-" + uuid.uuid4().hex
CREDENTIAL_KEY = "wafl-credential"
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
CONFIG = {"num_clients": 2, "rounds": 2, "join_timeout_s": 120, "checkpoint": False, "eval_every": 0}


@pytest.mark.parametrize("token", [TOKEN, ""], ids=["token", "open"])
def test_a_join_whose_reply_was_lost_can_be_repeated(stubs, tmp_path: Path, token: str) -> None:
    pb, pb_grpc = stubs
    args = ["--token-file", str(tmp_path / "token")] if token else []
    (tmp_path / "token").write_text(token)
    server = ServerProcess(CONFIG, tmp_path / "server", extra_args=args)
    c = IndependentClient(pb, pb_grpc, server.address, "client-0", 0, 10)
    c.token = token
    try:
        lost = c.join().session_credential  # registered, but say its reply never arrived
        c.credential = ""
        again = c.join()  # the retry with the token alone: before, PERMISSION_DENIED
        assert again.session_credential.startswith("0.") and again.session_credential != lost
        # the new session replaces the one whose reply was lost: only the new credential speaks for index 0
        expect_status(call_error(lambda: next(iter(c.broadcasts(metadata=((CREDENTIAL_KEY, lost),))))), UNAUTH)
        call = c.broadcasts(timeout=60)  # the new session confirms itself: its stream is open
        time.sleep(0.5)
        # now it is live: the same id with the token alone cannot take it over
        twin = IndependentClient(pb, pb_grpc, server.address, "client-0", 0, 10)
        twin.token = token
        try:
            err = call_error(lambda: twin.join())
            expect_status(err, grpc.StatusCode.PERMISSION_DENIED, "session is live", "session credential")
            # the stream ends (the client is gone); after the grace the index is free to its id again
            call.cancel()
            time.sleep(REJOIN_GRACE_S + 1.0)
            assert twin.join().session_credential.startswith("0.")
            expect_status(call_error(lambda: next(iter(c.broadcasts()))), UNAUTH)  # c's session was replaced
        finally:
            twin.close()
        # another id never takes the index, live or not
        other = IndependentClient(pb, pb_grpc, server.address, "someone-else", 0, 10)
        other.token = token
        try:
            expect_status(call_error(lambda: other.join()), grpc.StatusCode.ALREADY_EXISTS)
        finally:
            other.close()
        assert server.alive(), server.log_tail()
    finally:
        c.close()
        server.stop()


def _rows(out: Path) -> list[dict]:
    p = out / "results.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _wait_for(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_client_killed_and_restarted_without_its_state_rejoins(tmp_path: Path) -> None:
    """Real processes over a socket, under a run token: ``wafl client`` 1 is killed with -9 after round 2 and
    started again without ``--state-dir``; it joins its index again, trains in the rounds after, and the
    run and both clients end with status 0 and no traceback."""
    rounds = 6
    out = tmp_path / "run"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"num_clients": 2, "rounds": rounds, "local_epochs": 1, "round_deadline_s": 60}))
    ready = tmp_path / "server.json"
    env = dict(os.environ, WAFL_TOKEN=TOKEN, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    wafl = [sys.executable, "-m", "wafl.cli.main"]
    logs = {name: open(tmp_path / f"{name}.stderr", "wb") for name in ("server", "c0", "c1", "c1-again")}
    procs: list[subprocess.Popen] = []

    def client(i: int, name: str) -> subprocess.Popen:
        cmd = [*wafl, "client", "--server", address, "--index", str(i), "--reconnect-s", "90"]
        cmd += ["--log-file", str(tmp_path / f"{name}.jsonl"), "--quiet"]
        p = subprocess.Popen(cmd, stdout=logs[name], stderr=subprocess.STDOUT, env=env)
        procs.append(p)
        return p

    try:
        server = subprocess.Popen(
            [*wafl, "server", "--config", str(cfg), "--host", "127.0.0.1", "--port", "0", "--out", str(out)]
            + ["--ready-file", str(ready), "--quiet"],
            stdout=logs["server"],
            stderr=subprocess.STDOUT,
            env=env,
        )
        procs.append(server)
        _wait_for(ready.exists, 120, "the server to listen")
        address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
        c0, c1 = client(0, "c0"), client(1, "c1")
        _wait_for(lambda: len(_rows(out)) >= 2, 240, "two rounds before the kill")
        c1.send_signal(signal.SIGKILL)
        c1.wait()
        killed_after = len(_rows(out))
        again = client(1, "c1-again")  # no --state-dir: no credential to present
        assert server.wait(timeout=300) == 0, (out / "logs" / "server.jsonl").read_text()[-3000:]
        assert c0.wait(timeout=60) == 0
        assert again.wait(timeout=60) == 0, (tmp_path / "c1-again.stderr").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    for name in ("server", "c0", "c1-again"):
        assert "Traceback" not in (tmp_path / f"{name}.stderr").read_text(errors="replace"), name
    rows = _rows(out)
    assert rows[-1]["round"] == rounds
    events = [json.loads(line) for line in (tmp_path / "c1-again.jsonl").read_text().splitlines()]
    assert any(e["event"] == "joined" for e in events)
    server_log = [json.loads(line) for line in (out / "logs" / "server.jsonl").read_text().splitlines()]
    rejoins = [e for e in server_log if e.get("event") == "client.join" and e.get("client") == "client-1"]
    assert len(rejoins) >= 2 and rejoins[-1]["rejoin"] is True
    # the restarted client trained again: its uploads were accepted in rounds after the kill
    late = [r for r in rows if r["round"] > killed_after + 1]
    assert late and all(r["clients"] == 2 for r in late), late

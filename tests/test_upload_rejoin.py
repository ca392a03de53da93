"""An upload whose retry reaches a server that lost the client's session (killed and resumed with
``--resume``) joins again and retries, instead of ending the client.

The chaos run (``docs/measurements/chaos.md``, fault 1) saw a client's upload retry reach a resumed server
before its broadcast stream had joined again: the server answered ``NOT_FOUND`` ("unknown client_id ...:
call Join first"), ``Session.upload`` retried only the transient codes, and the process ended with a
traceback 0.24 s before its stream re-joined. Here the real ``Session`` talks over a socket to a real
``wafl server`` process that is killed with -9 and resumed on the same port, and the upload is made
before (and, once, at the same time as) the broadcast stream notices.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest
from independent_client import ServerProcess
from test_resilience import free_port, wait_for
from wafl.client.session import Session

CONFIG = {"num_clients": 1, "rounds": 5, "local_epochs": 1, "eval_every": 0, "round_deadline_s": 60, "seed": 3}
pytestmark = pytest.mark.timeout(600)


def _kill(server: ServerProcess) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    server._log.close()


def _resume(work: Path, port: int) -> ServerProcess:
    (work / "server.json").unlink(missing_ok=True)  # the killed server's ready file
    return ServerProcess(CONFIG, work, extra_args=["--port", str(port), "--resume"])


def _joins_since_last_resume(server: ServerProcess) -> list[dict]:
    """The ``client.join`` lines the newest incarnation logged (the log file is shared by every incarnation)."""
    path = server.out_dir / "logs" / "server.jsonl"
    import json

    lines = [json.loads(line) for line in path.read_text(errors="replace").splitlines() if line.startswith("{")]
    last = max(i for i, rec in enumerate(lines) if rec.get("event") == "resume")
    return [rec for rec in lines[last:] if rec.get("event") == "client.join"]


async def _first_model(session: Session):
    models = session.models()
    try:
        async for model in models:
            return model
    finally:
        await models.aclose()
    raise AssertionError("the broadcast stream ended without a model")


def test_an_upload_that_meets_a_resumed_server_rejoins_and_retries(tmp_path: Path) -> None:
    work = tmp_path / "server"
    port = free_port()
    server = ServerProcess(CONFIG, work, extra_args=["--port", str(port)])
    servers = [server]

    async def scenario() -> None:
        nonlocal server
        s = Session(f"127.0.0.1:{port}", "client-0", 0, num_samples=10, reconnect_s=120)
        try:
            reply = await s.join()
            n = reply.max_samples
            model = await _first_model(s)
            assert model.round == 1 and model.train
            assert await s.upload(1, model.state, n, {}) > 0  # version 2 is built and checkpointed
            wait_for(lambda: (server.out_dir / "results.jsonl").exists(), 120, "round 1's results line")

            # 1. the server is killed and resumed; the upload for round 2 reaches it before any stream
            # re-joined: before the fix, AioRpcError NOT_FOUND ("unknown client_id 'client-0': call Join first")
            _kill(server)
            server = _resume(work, port)
            servers.append(server)
            got = await s.upload(2, model.state, n, {})
            assert got > 0, server.log_tail()  # joined again, then the retry was accepted into round 2
            assert s.joins == 2
            assert [j["client"] for j in _joins_since_last_resume(server)] == ["client-0"]
            wait_for(lambda: server.events("round.done") and server.events("round.done")[-1]["round"] == 2, 120, "2")

            # 2. again, now with the broadcast stream and a stale upload (round 2 is closed: round 3 is open)
            # finding the session gone at the same time: one Join between them, the upload refused as stale
            _kill(server)
            server = _resume(work, port)
            servers.append(server)
            stale, fresh = await asyncio.gather(s.upload(2, model.state, n, {}), _first_model(s))
            assert stale == 0  # FAILED_PRECONDITION: handled as a refusal, as before
            assert fresh.round == 3 and fresh.train
            assert s.joins == 3, "the stream and the upload joined once between them"
            assert len(_joins_since_last_resume(server)) == 1

            # 3. a refusal that retrying cannot mend ends the client with one line, not an AioRpcError
            with pytest.raises(ConnectionError, match=r"refused the upload for round 3 \(INVALID_ARGUMENT\)"):
                await s.upload(3, model.state, n + 10**6, {})
        finally:
            await s.close()

    try:
        asyncio.run(scenario())
    except grpc.aio.AioRpcError as e:  # what the code before the fix let through
        raise AssertionError(f"the upload ended the client: {e.code().name} {e.details()}") from None
    finally:
        for srv in servers:
            srv.stop()
    assert all(srv.proc.returncode in (0, -signal.SIGKILL, -signal.SIGTERM) for srv in servers)
    assert "Traceback" not in "".join(srv.log_path.read_text(errors="replace") for srv in servers)

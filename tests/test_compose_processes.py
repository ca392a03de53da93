"""The compose file's server and client, translated to processes on localhost (volumes -> temporary
folders, the port -> a free one) and started through the entrypoint, run one round of a two-client
federation, the clients claiming their indices as in the containers."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.docker_helpers import (
    COMPOSE,
    ENTRYPOINT,
    clean_env,
    compose_config,
    dockerfile_instructions,
    free_port,
    service_environment,
    service_mounts,
    service_replicas,
    stop_processes,
)


def _wait_healthy(
    health: list[str], env: dict[str, str], server: subprocess.Popen[bytes], port: int, log: Path, timeout: float = 180
) -> str:
    """Runs the health check until it passes (as Docker does), once the port accepts connections."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited with {server.returncode}:\n{log.read_text()[-3000:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:  # not listening yet: no need to start a probe process
            time.sleep(0.2)
            continue
        probe = subprocess.run(health, env=env, capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return probe.stdout
        time.sleep(0.5)
    raise AssertionError(f"the server never became healthy:\n{log.read_text()[-3000:]}")


def _image_entrypoint() -> list[str]:
    """The image's ENTRYPOINT, translated: tini is a PID 1 concern, wafl-entrypoint is the script."""
    entry = json.loads(next(r for w, r in reversed(dockerfile_instructions()) if w == "ENTRYPOINT"))
    assert entry[-1] == "wafl-entrypoint"
    return [sys.executable, str(ENTRYPOINT)]


@pytest.mark.slow
def test_compose_federation_as_processes(tmp_path: Path) -> None:
    """The compose file's server and two client replicas, as local processes, run one round.

    The containers share the host's network, so processes on this machine are what they are,
    less the file system: the port is a free one (WAFL_PORT, as a user would set it), the
    clients dial 127.0.0.1 there and claim their indices among themselves.
    """
    port = free_port()
    cfg = compose_config(
        [COMPOSE],
        {
            "WAFL_CLIENTS": "2",
            "WAFL_ROUNDS": "1",
            "WAFL_DATASET": "digits",
            "WAFL_RUN": "compose-test",
            "WAFL_PORT": str(port),
            "WAFL_SERVER_ARGS": "--set local_epochs=1 --seed 3",
        },
    )
    server_svc, client_svc = cfg["services"]["server"], cfg["services"]["client"]
    # volumes -> folders: the named results volume and the data folder -> empty temporary folders
    # (digits needs no files), other bind mounts (configs) -> their host folders
    folders: dict[str, Path] = {}
    for target, source in {**service_mounts(server_svc), **service_mounts(client_svc)}.items():
        if target in ("/results", "/data") or not Path(source).is_dir():
            folders[target] = tmp_path / target.strip("/").replace("/", "_")
            folders[target].mkdir()
        else:
            folders[target] = Path(source)
    assert {"/results", "/data"} <= set(folders)

    def translate(value: str) -> str:
        for target, path in folders.items():
            if value == target or value.startswith(target + "/"):
                value = str(path) + value[len(target) :]
        return value

    def service_env(service: dict[str, Any], name: str) -> dict[str, str]:
        env = {k: translate(v) for k, v in service_environment(service).items()}
        env.update(WAFL_ROLE_FILE=str(tmp_path / f"{name}.role.json"), WAFL_RUN_AS="")  # processes stay this user
        return clean_env(**env)

    entry = _image_entrypoint()
    server_env = service_env(server_svc, "server")
    assert (server_env["WAFL_HOST"], server_env["WAFL_PORT"]) == ("127.0.0.1", str(port))
    server_cmd = [*entry, *(translate(a) for a in server_svc["command"])]
    health = [*entry, *server_svc["healthcheck"]["test"][2:]]  # ["CMD", "wafl-entrypoint", "--health"]
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(logs / "server.log", "wb") as f:
            server = subprocess.Popen(
                server_cmd, env=server_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs.append(server)
        # depends_on: condition: service_healthy
        assert (
            _wait_healthy(health, server_env, server, port, logs / "server.log").strip() == f"127.0.0.1:{port}: SERVING"
        )
        assert json.loads((tmp_path / "server.role.json").read_text()) == {
            "command": "server",
            "health": f"127.0.0.1:{port}",
        }
        replicas = service_replicas(client_svc)
        assert replicas == 2
        for replica in range(1, replicas + 1):
            env = service_env(client_svc, f"client-{replica}")
            with open(logs / f"client-{replica}.log", "wb") as f:
                procs.append(
                    subprocess.Popen(
                        [*entry, *client_svc["command"]],
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        try:
            server.wait(timeout=180)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                "the federation did not finish:\n" + "\n".join(p.read_text()[-2000:] for p in sorted(logs.iterdir()))
            ) from None
        codes = []
        for p in procs[1:]:
            codes.append(p.wait(timeout=60))
    finally:
        stop_processes(procs)
    server_log = (logs / "server.log").read_text()
    assert server.returncode == 0, server_log[-3000:]
    assert codes == [0, 0], [(logs / f"client-{i}.log").read_text()[-2000:] for i in (1, 2)]
    claimed = []
    for replica in (1, 2):
        m = re.search(
            r"client index (\d+) from a claim among the clients of 127\.0\.0\.1:(\d+)",
            (logs / f"client-{replica}.log").read_text(),
        )
        assert m and m.group(2) == str(port), (logs / f"client-{replica}.log").read_text()[-2000:]
        claimed.append(int(m.group(1)))
    assert sorted(claimed) == [0, 1]  # distinct, whichever started first
    out = tmp_path / "results" / "compose-test"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert rows[0]["round"] == 1 and 0.0 <= rows[0]["gm_accuracy"] <= 1.0
    assert rows[0]["clients"] == 2
    run_config = json.loads((out / "config.json").read_text())  # what the server resolved and sent to the clients
    assert (run_config["protocol"], run_config["algorithm"], run_config["num_clients"]) == ("wait-free", "fedavg", 2)
    assert (run_config["local_epochs"], run_config["seed"], run_config["data_dir"]) == (
        1,
        3,
        str(tmp_path / "data"),
    )  # WAFL_SERVER_ARGS, the /data mount
    # the run is over, the server is gone: the health check now fails
    after = subprocess.run(
        health, env={**server_env, "WAFL_HEALTH_TIMEOUT": "2"}, capture_output=True, text=True, timeout=60
    )
    assert after.returncode != 0

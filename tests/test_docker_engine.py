"""The container deployment on a real Docker engine, with the commands docker/README.md gives.

docker/local-engine.sh installs (when missing) and starts a private dockerd, builds the base and
the wafl images; then the compose file runs, to the end of a short run and with the results read
back from the volume:

* a federation: the server and three client replicas (``docker compose up --build``), clients
  claiming distinct indices on the host's network, results copied out with ``docker cp``;
* the protocol benchmark (``--profile bench``), both protocols;
* a federation behind shaped links through the network-namespace path (compose.shaped.yml), in
  a container with a network of its own.

It needs root (the script installs packages and runs dockerd) and a kernel that lets dockerd run
containers; elsewhere it skips and says why (``WAFL_ENGINE_TESTS=0`` skips it too). The first run
builds the images from nothing (about 6 minutes on 2 cores); later runs reuse them from the
engine's data root (/var/cache/wafl/engine) and rebuild only what changed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "docker" / "local-engine.sh"
COMPOSE = "docker/docker-compose.yml"
SHAPED = "docker/compose.shaped.yml"
ENGINE_START_S = 3600  # a cold start builds the images: minutes, not an hour

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(ENGINE_START_S + 1800)]


def _skip_reason() -> str | None:
    if os.environ.get("WAFL_ENGINE_TESTS", "").strip() == "0":
        return "WAFL_ENGINE_TESTS=0"
    if sys.platform != "linux":
        return "a Docker engine of this machine's own needs Linux"
    if os.geteuid() != 0:
        return "needs root: docker/local-engine.sh installs the engine's packages and runs its own dockerd"
    if shutil.which("bash") is None or shutil.which("flock") is None:
        return "docker/local-engine.sh needs bash and flock"
    return None


class Engine:
    """The running private engine: the environment docker/local-engine.sh gives its command."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self.log = log

    def compose_cli(self) -> list[str]:
        """``docker compose`` (v2) when the engine's CLI has it, else ``docker-compose`` (v1)."""
        probe = subprocess.run(["docker", "compose", "version"], env=self.env, capture_output=True, timeout=60)
        return ["docker", "compose"] if probe.returncode == 0 else ["docker-compose"]

    def run(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 900, check: bool = True) -> str:
        """Runs a command against the engine from the repository root; its output (the test fails on an error)."""
        start = time.monotonic()
        proc = subprocess.run(
            args,
            cwd=REPO,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        took = time.monotonic() - start
        print(f"$ {' '.join(args)}  ({took:.1f} s, exit {proc.returncode})")
        assert proc.returncode == 0 or not check, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
        return proc.stdout


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("engine")
    env_file, log = folder / "env.json", folder / "local-engine.log"
    # the command holds the engine until its stdin closes: at the end of this module, or when this
    # process dies however it dies; the script then stops the engine
    hold = (
        "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1] + '.tmp', 'w')); "
        "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); sys.stdin.read()"
    )
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", str(SCRIPT), sys.executable, "-c", hold, str(env_file)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        while not env_file.exists():
            code = proc.poll()
            if code == 77:
                lines = [line for line in log.read_text().splitlines() if "unavailable:" in line]
                pytest.skip(f"no Docker engine here: {lines[-1] if lines else log.read_text()[-500:]}")
            assert code is None, f"docker/local-engine.sh exited {code}:\n{log.read_text()[-6000:]}"
            assert time.monotonic() - start < ENGINE_START_S, f"no engine after {ENGINE_START_S} s:\n{log.read_text()}"
            time.sleep(1)
        print(f"engine ready after {time.monotonic() - start:.0f} s:")
        print("\n".join(line for line in log.read_text().splitlines() if line.startswith("local-engine:")))
        yield Engine(json.loads(env_file.read_text()), log)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "engine stopped" in log.read_text(), log.read_text()[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _project(name: str, tmp_path: Path) -> dict[str, str]:
    """A compose project of the test's own: its name, results volume, data folder, server port."""
    project = f"wafltest{os.getpid()}{name}"
    (tmp_path / "data").mkdir()
    return {
        "COMPOSE_FILE": COMPOSE,
        "COMPOSE_PROJECT_NAME": project,
        "WAFL_RESULTS_VOLUME": f"{project}-results",
        "WAFL_DATA": str(tmp_path / "data"),
        "WAFL_PORT": str(_free_port()),
    }


def _containers(engine: Engine, compose: list[str], env: dict[str, str], *args: str) -> list[str]:
    return engine.run([*compose, *args, "ps", "-a", "-q"], env).split()


def _exit_codes(engine: Engine, ids: list[str]) -> dict[str, int]:
    out = engine.run(["docker", "inspect", "--format", "{{.Name}} {{.State.ExitCode}}", *ids])
    return {name.lstrip("/"): int(code) for name, code in (line.split() for line in out.splitlines())}


def test_the_image(engine: Engine) -> None:
    """Non-root, the gRPC health check, the entrypoint; no pip setting of the build machine inside."""
    image = engine.env["WAFL_IMAGE"]
    config = json.loads(engine.run(["docker", "image", "inspect", "--format", "{{json .Config}}", image]))
    assert config["User"] == "wafl"
    assert config["Healthcheck"]["Test"] == ["CMD", "wafl-entrypoint", "--health"]
    assert config["Entrypoint"] == ["tini", "--", "wafl-entrypoint"]
    assert not [e for e in config["Env"] if e.startswith("PIP_")]
    script = (
        "id -u; echo ---; pip config list; echo ---; ls -A /run/secrets 2>/dev/null; echo ---; "
        "cat /etc/pip.conf /etc/xdg/pip/pip.conf /home/wafl/.config/pip/pip.conf 2>/dev/null; echo ---; "
        "wafl --help | head -n 1"
    )
    inside = engine.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh", image, "-c", script])
    uid, pip_config, secrets, config_files, usage = (part.strip() for part in inside.split("---\n"))
    assert uid == "10001" and usage.startswith("usage: wafl"), inside
    assert pip_config == secrets == config_files == "", inside
    history = engine.run(["docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", image])
    assert "127.0.0.1:" not in history and "/opt/wheels" not in history  # no URL or path of this machine's pip


def test_compose_federation(engine: Engine, tmp_path: Path) -> None:
    """`WAFL_CLIENTS=3 WAFL_ROUNDS=3 docker compose up --build`, then the results out of the volume."""
    compose = engine.compose_cli()
    env = _project("fed", tmp_path)
    env.update(WAFL_CLIENTS="3", WAFL_ROUNDS="3", WAFL_SERVER_ARGS="--set local_epochs=1 --seed 5")
    env.update(WAFL_SERVER_CPUS="1", WAFL_CLIENT_CPUS="0.5")  # a CPU share per container, read back below
    try:
        start = time.monotonic()
        logs = engine.run([*compose, "up", "--build"], env)
        print(f"compose federation: {time.monotonic() - start:.1f} s")
        ids = _containers(engine, compose, env)
        codes = _exit_codes(engine, ids)
        assert len(codes) == 4 and set(codes.values()) == {0}, (codes, logs[-6000:])
        server = _server_id(engine, compose, env)
        quotas = {i: int(engine.run(["docker", "inspect", "--format", "{{.HostConfig.NanoCpus}}", i])) for i in ids}
        assert quotas.pop(server) == 1_000_000_000 and sorted(quotas.values()) == [500_000_000] * 3, quotas
        claimed = sorted(int(i) for i in re.findall(r"client index (\d+) from a claim among the clients of", logs))
        assert claimed == [0, 1, 2], logs[-6000:]
        engine.run(["docker", "cp", f"{server}:/results/federation", str(tmp_path / "out")])
    finally:
        engine.run([*compose, "down", "-v"], env, check=False)
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["clients"] == 3 and 0.0 <= r["gm_accuracy"] <= 1.0 for r in rows), rows
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["num_clients"], config["rounds"], config["local_epochs"], config["seed"]) == (3, 3, 1, 5)
    assert (config["dataset"], config["data_dir"]) == ("digits", "/data")


def _server_id(engine: Engine, compose: list[str], env: dict[str, str]) -> str:
    ids = engine.run([*compose, "ps", "-a", "-q", "server"], env).split()
    assert len(ids) == 1, ids
    return ids[0]


def test_compose_benchmark_profile(engine: Engine, tmp_path: Path) -> None:
    """`docker compose --profile bench up --build bench`: both protocols, protocols.json in the volume."""
    compose = engine.compose_cli()
    env = _project("bench", tmp_path)
    env.update(WAFL_CLIENTS="2", WAFL_ROUNDS="2", WAFL_BENCH_ARGS="--set local_epochs=1")
    try:
        logs = engine.run([*compose, "--profile", "bench", "up", "--build", "bench"], env)
        ids = engine.run([*compose, "--profile", "bench", "ps", "-a", "-q", "bench"], env).split()
        assert list(_exit_codes(engine, ids).values()) == [0], logs[-6000:]
        engine.run(["docker", "cp", f"{ids[0]}:/results/bench", str(tmp_path / "bench")])
    finally:
        engine.run([*compose, "--profile", "bench", "down", "-v"], env, check=False)
    summary = json.loads((tmp_path / "bench" / "protocols.json").read_text())
    text = json.dumps(summary)
    assert "wait-free" in text and "compute-and-wait" in text
    assert summary["config"]["rounds_per_protocol"]["compute-and-wait"] == 2  # wait-free: as many as fit in its time
    for protocol in ("wait-free", "compute-and-wait"):
        rows = (tmp_path / "bench" / protocol / "results.jsonl").read_text().splitlines()
        assert len(rows) == summary["config"]["rounds_per_protocol"][protocol], protocol


def test_compose_shaped_links(engine: Engine, tmp_path: Path) -> None:
    """The network-namespace path in a container of its own network: a whole federation, links shaped."""
    compose = engine.compose_cli()
    env = _project("shaped", tmp_path)
    env.update(COMPOSE_FILE=f"{COMPOSE}:{SHAPED}", WAFL_LINK_RATE="20mbit")
    name = f"{env['COMPOSE_PROJECT_NAME']}-run"
    try:
        logs = engine.run(
            [*compose, "--profile", "bench", "run", "-T", "--name", name, "bench",
             "run", "--clients", "2", "--rounds", "1", "--set", "local_epochs=1", "--out", "/results/shaped"],
            env,
        )  # fmt: skip
        assert "links shaped to 20mbit in network namespaces" in logs and "status          ok" in logs, logs[-6000:]
        # the namespaces, links and bridge of the run lived in the container's own network namespace
        assert engine.run(["docker", "inspect", "--format", "{{.HostConfig.NetworkMode}}", name]).strip() == "none"
        engine.run(["docker", "cp", f"{name}:/results/shaped", str(tmp_path / "out")])
    finally:
        engine.run(["docker", "rm", "-f", name], check=False)
        engine.run([*compose, "--profile", "bench", "down", "-v"], env, check=False)
    rows = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["clients"] == 2

"""Container deployment (docker/): what can be checked without a Docker engine.

(tests/test_docker_engine.py builds the image and runs the compose files on a real engine;
tests/test_pip_settings.py checks scripts/pip-settings.py, which a build reads the machine's pip settings with.)

* the compose files validate (``docker-compose config``; without it, a PyYAML structural check;
  without either, those tests skip and say why) and their commands parse with the wafl CLI;
* the Dockerfile's structure, its dependency split, pip settings only as build secrets;
* the entrypoint, run outside a container: client index derivation (environment, claims on a
  shared network, names, reverse DNS against a local fake DNS server), the shaping command built
  for WAFL_LINK_RATE, the refusals on the host's network and without CAP_NET_ADMIN, privilege
  dropping, the health probe against a real server and a closed port;
* the compose file's server and client, translated to processes on localhost (volumes ->
  temporary folders, the port -> a free one) and started through the entrypoint, run one round
  of a two-client federation, the clients claiming their indices as in the containers.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
SHAPED = DOCKER / "compose.shaped.yml"
GPU = DOCKER / "compose.gpu.yml"
TLS = DOCKER / "compose.tls.yml"
DOCKERFILE = DOCKER / "Dockerfile"
IGNORE = DOCKER / "Dockerfile.dockerignore"
ENTRYPOINT = DOCKER / "entrypoint.py"
EXPECTED_TC = "tc qdisc replace dev {dev} root tbf rate 20000000bit burst 32768b latency 50ms"


sys.path.insert(0, str(DOCKER))  # the entrypoint's package, wafl_entry/, as the script finds it
from wafl_entry import claims  # noqa: E402
from wafl_entry import dns as entry_dns  # noqa: E402
from wafl_entry.claims import claim_index, claim_name  # noqa: E402
from wafl_entry.dns import nameservers  # noqa: E402
from wafl_entry.errors import EntrypointError  # noqa: E402
from wafl_entry.index import derive_index, replica_number  # noqa: E402
from wafl_entry.main import main as entrypoint_main  # noqa: E402
from wafl_entry.privileges import drop_privileges  # noqa: E402
from wafl_entry.shaping import has_net_admin  # noqa: E402


def _clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without WAFL_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAFL_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _entrypoint(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- compose config


_YAML_TO_JSON = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"


@functools.cache
def _compose_cli() -> tuple[tuple[str, ...], int] | None:
    """The compose command and its major version (1: Python docker-compose, 2: the Go one)."""
    candidates = []
    if shutil.which("docker-compose"):
        candidates.append((shutil.which("docker-compose") or "docker-compose",))
    if shutil.which("docker"):
        candidates.append(("docker", "compose"))
    for cli in candidates:
        probe = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True, timeout=60)
        m = re.match(r"v?(\d+)\.", probe.stdout.strip())
        if probe.returncode == 0 and m:
            return cli, int(m.group(1))
    return None


def _yaml_converters(program: str) -> Iterator[list[str]]:
    """Interpreters with PyYAML: this one, then the one docker-compose (v1, Python) runs on."""
    try:
        import yaml  # noqa: F401

        yield [sys.executable, "-c", _YAML_TO_JSON]
    except ImportError:
        pass
    first = Path(program)
    try:
        shebang = first.read_bytes()[:200].split(b"\n", 1)[0].decode()
    except (OSError, UnicodeDecodeError):
        return
    if shebang.startswith("#!") and "python" in shebang:
        yield [*shlex.split(shebang[2:]), "-c", _YAML_TO_JSON]


_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _INTERP.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


def compose_config(
    files: list[Path], env: dict[str, str] | None = None, profiles: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The resolved compose configuration of ``files``, as docker-compose sees it."""
    return json.loads(_compose_config(tuple(files), tuple(sorted((env or {}).items())), profiles))


@functools.cache
def _compose_config(files: tuple[Path, ...], env_items: tuple[tuple[str, str], ...], profiles: tuple[str, ...]) -> str:
    env = {**_clean_env(), **dict(env_items)}
    found = _compose_cli()
    if found is None:
        try:
            import yaml
        except ImportError:
            pytest.skip(
                "neither docker-compose (Debian package docker-compose) nor PyYAML is available "
                "to read the compose files"
            )
        if len(files) != 1:
            pytest.skip("merging compose override files needs docker-compose")
        raw = yaml.safe_load(files[0].read_text())
        return json.dumps(_interpolate({k: v for k, v in raw.items() if not k.startswith("x-")}, env))
    cli, major = found
    cmd = [*cli, "--project-directory", str(DOCKER)]
    for f in files:
        cmd += ["-f", str(f)]
    for p in profiles:
        cmd += ["--profile", p]
    cmd.append("config")
    if major >= 2:
        cmd += ["--format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, f"{shlex.join(cmd)} failed:\n{proc.stderr}"
    if major >= 2:
        return proc.stdout
    for conv in _yaml_converters(cli[0]):
        out = subprocess.run(conv, input=proc.stdout, capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return out.stdout
    pytest.skip(f"{shlex.join(cmd)} validated the file, but no PyYAML is available to read its output")


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> source, for the short (``src:dst[:mode]``) and long volume syntax."""
    out = {}
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            out[v["target"]] = str(v.get("source", ""))
        else:
            parts = v.split(":")
            out[parts[1]] = parts[0]
    return out


def _replicas(service: dict[str, Any]) -> int:
    return int((service.get("deploy") or {}).get("replicas", service.get("scale", 1)))


def test_compose_file_validates() -> None:
    cfg = compose_config([COMPOSE], profiles=("bench",))
    services = cfg["services"]
    assert {"server", "client"} <= set(services)
    server, client = services["server"], services["client"]
    # one image for both roles, the role is the command
    assert server["image"] == client["image"]
    assert server["command"][0] == "server" and client["command"] == ["client"]
    assert _mounts(server)["/configs"].endswith("configs")  # the paper configs, for --config
    # the shared results volume and the data folder
    assert _mounts(server)["/results"] == _mounts(client)["/results"]
    assert "/data" in _mounts(server) and "/data" in _mounts(client)
    assert "results" in cfg["volumes"]
    # the health check is the gRPC health probe of the entrypoint, clients wait for it
    assert server["healthcheck"]["test"][-2:] == ["wafl-entrypoint", "--health"]
    assert client["depends_on"]["server"]["condition"] == "service_healthy"
    # scaled replicas must not share a fixed name; on the host's network they claim their index
    assert "container_name" not in client and "hostname" not in client
    assert _environment(client)["WAFL_CLIENT_INDEX"] == ""
    assert _environment(client)["WAFL_CLIENT_INDEX_FROM"] == "claim"
    # the host's network: the server on loopback, the clients dial it there (empty: 127.0.0.1:WAFL_PORT)
    assert _environment(server)["WAFL_HOST"] == "127.0.0.1"
    assert _environment(server)["WAFL_PORT"] == _environment(client)["WAFL_PORT"] == "50051"
    assert _environment(client)["WAFL_SERVER"] == ""
    assert _replicas(client) == 4
    for service in services.values():
        assert service["network_mode"] == "host"
        assert "ports" not in service  # nothing to publish on the host's network
        assert service["build"]["network"] == "host"
        assert service["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim-bookworm", "TORCH_VARIANT": "cpu"}
    for service in (server, client):
        assert "WAFL_LINK_RATE" in _environment(service)
        assert _environment(service)["WAFL_HOST_NETWORK"] == "1"  # the entrypoint never shapes the host's eth0


def test_compose_environment_switches() -> None:
    env = {
        "WAFL_PROTOCOL": "compute-and-wait",
        "WAFL_ALGORITHM": "fedprox",
        "WAFL_CLIENTS": "7",
        "WAFL_ROUNDS": "3",
        "WAFL_RUN": "cw",
        "WAFL_DATASET": "cifar10",
        "WAFL_LINK_RATE": "5mbit",
    }
    cfg = compose_config([COMPOSE], env)
    server, client = cfg["services"]["server"], cfg["services"]["client"]
    cmd = server["command"]
    for flag, value in (
        ("--protocol", "compute-and-wait"),
        ("--algorithm", "fedprox"),
        ("--clients", "7"),
        ("--rounds", "3"),
        ("--dataset", "cifar10"),
        ("--out", "/results/cw"),
    ):
        assert cmd[cmd.index(flag) + 1] == value
    assert _replicas(client) == 7
    assert _environment(client)["WAFL_STATE_DIR"] == "/results/cw/clients"
    ports = compose_config([COMPOSE], {"WAFL_PORT": "50123", "WAFL_HOST": "0.0.0.0"})["services"]
    assert _environment(ports["server"])["WAFL_PORT"] == _environment(ports["client"])["WAFL_PORT"] == "50123"
    assert _environment(ports["server"])["WAFL_HOST"] == "0.0.0.0"
    built = compose_config([COMPOSE], {"WAFL_BASE_IMAGE": "wafl-base:bookworm", "WAFL_TORCH_VARIANT": "pypi"})
    assert built["services"]["server"]["build"]["args"] == {"BASE_IMAGE": "wafl-base:bookworm", "TORCH_VARIANT": "pypi"}
    assert _environment(server)["WAFL_LINK_RATE"] == _environment(client)["WAFL_LINK_RATE"] == "5mbit"


def test_compose_cpu_shares() -> None:
    """WAFL_SERVER_CPUS and WAFL_CLIENT_CPUS hold the server and each client replica to a CPU share, as
    `wafl run --host-cpus` does with control groups; unset, every container may use every core."""
    services = compose_config([COMPOSE])["services"]
    assert float(services["server"].get("cpus", 0)) == float(services["client"].get("cpus", 0)) == 0.0
    held = compose_config([COMPOSE], {"WAFL_SERVER_CPUS": "1", "WAFL_CLIENT_CPUS": "0.25"})["services"]
    assert float(held["server"]["cpus"]) == 1.0 and float(held["client"]["cpus"]) == 0.25


def test_compose_benchmark_profile() -> None:
    cfg = compose_config([COMPOSE], {"WAFL_CLIENTS": "3", "WAFL_ROUNDS": "5"}, profiles=("bench",))
    bench = cfg["services"]["bench"]
    assert bench["profiles"] == ["bench"]
    assert bench["command"][:2] == ["bench", "protocols"]
    out = bench["command"][bench["command"].index("--out") + 1]
    results = _mounts(bench)["/results"]
    assert out.startswith("/results/") and results == _mounts(cfg["services"]["server"])["/results"]
    assert bench["command"][bench["command"].index("--clients") + 1] == "3"
    # the protocols differ only with a personalized model: the default is scd
    assert bench["command"][bench["command"].index("--algorithm") + 1] == "scd"
    assert bench["image"] == cfg["services"]["server"]["image"]


def test_compose_commands_parse_with_the_cli() -> None:
    """What the services run is accepted by the wafl CLI itself (no flag the CLI lacks)."""
    from wafl.cli.main import build_parser

    cfg = compose_config([COMPOSE], profiles=("bench",))
    parser = build_parser()
    for name in ("server", "client", "bench"):
        command = cfg["services"][name]["command"]
        if name == "client":
            command = [*command, "--index", "0"]  # what the entrypoint supplies (as WAFL_CLIENT_INDEX)
        args = parser.parse_args(command)
        assert args.command == command[0]
    server = parser.parse_args(cfg["services"]["server"]["command"])
    assert (server.num_clients, server.rounds, server.protocol, server.algorithm) == (4, 25, "wait-free", "fedavg")


def test_compose_overrides_validate() -> None:
    shaped = compose_config([COMPOSE, SHAPED], profiles=("bench",))["services"]
    # the network-namespace path: root with the two capabilities it needs (not privileged), own network
    bench = shaped["bench"]
    assert str(bench["user"]).startswith("0") and sorted(bench["cap_add"]) == ["NET_ADMIN", "SYS_ADMIN"]
    assert "privileged" not in bench and bench["network_mode"] == "none"
    for name in ("server", "client"):  # on the host's network: no capability to touch its interfaces
        assert "cap_add" not in shaped[name] and "privileged" not in shaped[name]
        assert shaped[name]["network_mode"] == "host"
    gpu = compose_config([COMPOSE, GPU], profiles=("bench",))["services"]
    assert gpu["client"]["build"]["args"]["TORCH_VARIANT"] == "cu128"
    assert gpu["client"]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim-bookworm"
    assert gpu["client"]["build"]["network"] == "host" and gpu["client"]["network_mode"] == "host"
    devices = gpu["client"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert _environment(gpu["client"])["WAFL_DEVICE"] == "cuda"
    assert _replicas(gpu["client"]) == 4  # the base file's replica count survives the merge
    tls = compose_config([COMPOSE, TLS], env={"WAFL_CERTS": "/srv/certs"})["services"]
    for name in ("server", "client"):
        env = _environment(tls[name])
        assert env["WAFL_TLS_CA"] == "/certs/ca.pem" and env["WAFL_TLS_SERVER_NAME"] == "server"
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in tls[name]["volumes"]]
        assert any(m.startswith("/srv/certs:/certs") for m in mounts), mounts
        assert any("/data" in m for m in mounts)  # the base file's volumes survive the merge
    assert _environment(tls["server"])["WAFL_TLS_KEY"] == "/certs/server.key"
    assert _environment(tls["server"])["WAFL_TOKEN"] == ""  # and its environment


# --------------------------------------------------------------------------- Dockerfile


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_structure() -> None:
    ins = _instructions()
    runtime = ins[max(i for i, (w, r) in enumerate(ins) if w == "FROM") :]
    users = [r for w, r in runtime if w == "USER"]
    assert users and users[-1] not in ("root", "0", "0:0")
    entry = json.loads(next(r for w, r in runtime if w == "ENTRYPOINT"))
    assert entry[-1] == "wafl-entrypoint"
    health = next(r for w, r in runtime if w == "HEALTHCHECK")
    assert json.loads(health[health.index("CMD") + 3 :].strip()) == ["wafl-entrypoint", "--health"]
    # the script and its package side by side, the command on the PATH a link to the script
    copies = [r.split()[-2:] for w, r in runtime if w == "COPY"]
    assert ["docker/entrypoint.py", "/opt/wafl-entrypoint/entrypoint.py"] in copies
    assert ["docker/wafl_entry", "/opt/wafl-entrypoint/wafl_entry"] in copies
    link = "ln -s /opt/wafl-entrypoint/entrypoint.py /usr/local/bin/wafl-entrypoint"
    assert any(w == "RUN" and link in r for w, r in runtime)
    assert any(w == "ARG" and r == "TORCH_VARIANT=cpu" for w, r in ins)
    assert "https://download.pytorch.org/whl/${TORCH_VARIANT}" in DOCKERFILE.read_text()
    # dependencies are installed before the package source is copied (cache layering)
    deps_install = next(
        i for i, (w, r) in enumerate(ins) if w == "RUN" and "requirements.txt" in r and "pip install" in r
    )
    first_source = next(
        i for i, (w, r) in enumerate(ins) if w == "COPY" and r.split()[0] in ("common", "server", "client", "cli")
    )
    assert deps_install < first_source


def test_dockerfile_base_image_and_pip_settings() -> None:
    """The base is a build argument; the machine's pip settings enter as build secrets, never a layer."""
    ins = _instructions()
    first_from = next(i for i, (w, _) in enumerate(ins) if w == "FROM")
    assert ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm") in ins[:first_from]
    stages = set()
    for word, rest in ins:
        if word == "FROM":
            image, _, stage = rest.partition(" AS ")
            assert image == "${BASE_IMAGE}" or image in stages, rest
            stages.add(stage.strip())
    assert {"requirements", "deps", "wheel", "runtime"} <= stages
    installs = [r for w, r in ins if w == "RUN" and "pip install" in r]
    assert installs
    for run in installs:
        offline = "--no-deps" in run and "--mount=type=secret" not in run  # the wafl wheel, built in the image
        secrets = "--mount=type=secret,id=pip.conf" in run and "--mount=type=secret,id=pip-cert" in run
        assert offline or secrets, run
        if secrets:
            assert "PIP_CONFIG_FILE=/run/secrets/pip.conf" in run and "PIP_CERT=/run/secrets/pip-cert" in run
    for word, rest in ins:  # no layer, environment or argument of the image carries pip's settings
        if word in ("ENV", "ARG", "LABEL", "COPY", "ADD"):
            assert "PIP_" not in rest and "pip.conf" not in rest and "pip-cert" not in rest, rest
    runtime = ins[max(i for i, (w, r) in enumerate(ins) if w == "FROM") :]
    assert runtime[0] == ("FROM", "deps AS runtime")  # the dependencies' layers, not a copy of the venv
    assert not any(w == "COPY" and "/opt/venv" in r for w, r in ins)


def test_dockerfile_sources_are_in_the_build_context() -> None:
    """Every COPY source exists and passes the allow-list of Dockerfile.dockerignore."""
    allowed = [line[1:] for line in IGNORE.read_text().splitlines() if line.startswith("!")]
    assert "*" in IGNORE.read_text().splitlines()  # everything else is excluded
    sources = []
    for word, rest in _instructions():
        if word == "COPY" and "--from=" not in rest:
            sources += [s for s in rest.split()[:-1] if not s.startswith("--")]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded from the build context"


def test_dockerfile_dependency_split(tmp_path: Path) -> None:
    """The requirements stage's script puts torch/torchvision apart from the other dependencies."""
    run = shlex.split(next(r for w, r in _instructions() if w == "RUN" and "tomllib" in r))
    code = run[run.index("-c") + 1]
    code = code.replace("/src/pyproject.toml", str(REPO / "pyproject.toml")).replace("/requirements/", f"{tmp_path}/")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = (tmp_path / "torch.txt").read_text().split()
    rest = (tmp_path / "requirements.txt").read_text().split()
    assert sorted(d.split("==")[0] for d in torch) == ["torch", "torchvision"]
    assert sorted(torch + rest) == sorted(deps)


# --------------------------------------------------------------------------- entrypoint: index


def _names(*pairs: tuple[str, str | None]) -> Any:
    return lambda env: iter(pairs)


@pytest.mark.parametrize(
    ("name", "offset", "expected"),
    [
        ("wafl-client-1", "", 0),  # compose v2 container name, replica 1
        ("wafl_client_3", "", 2),  # compose v1
        ("docker-client-12.docker_default", "", 11),  # Docker's reverse DNS answer
        ("docker-client-2.docker_default.", "4", 5),  # second host: index offset
        ("client-7", "0", 6),  # swarm: hostname: client-{{.Task.Slot}}
    ],
)
def test_index_from_replica_name(name: str, offset: str, expected: int) -> None:
    env = {"WAFL_CLIENT_INDEX_OFFSET": offset}
    index, source = derive_index(env, _names(("hostname", "0123456789ab"), ("reverse DNS", name)))
    assert index == expected
    assert name in source


def test_index_from_environment_wins() -> None:
    assert derive_index(
        {"WAFL_CLIENT_INDEX": "5", "WAFL_CLIENT_INDEX_OFFSET": "9"}, _names(("hostname", "x-client-2"))
    ) == (5, "WAFL_CLIENT_INDEX")
    with pytest.raises(EntrypointError, match="WAFL_CLIENT_INDEX='one'"):
        derive_index({"WAFL_CLIENT_INDEX": "one"}, _names())


def test_index_failures_say_what_to_do() -> None:
    with pytest.raises(EntrypointError) as info:
        derive_index({}, _names(("hostname", "3f2a1b9c0d12"), ("reverse DNS of 172.18.0.4 via 127.0.0.11:53", None)))
    message = str(info.value)
    assert info.value.code == 2
    assert "WAFL_CLIENT_INDEX" in message and "--scale client=N" in message
    assert "hostname '3f2a1b9c0d12'" in message and "127.0.0.11:53: no name" in message
    with pytest.raises(EntrypointError, match="start at 1"):
        derive_index({}, _names(("WAFL_CLIENT_NAME", "client-0")))
    with pytest.raises(EntrypointError, match="OFFSET"):
        derive_index({"WAFL_CLIENT_INDEX_OFFSET": "-1"}, _names(("hostname", "client-1")))


class FakeDNS:
    """A UDP DNS server on localhost answering every PTR query with ``name`` (or NXDOMAIN)."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.queries: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                msg, peer = self.sock.recvfrom(512)
            except OSError:
                continue
            qid = msg[:2]
            end = msg.index(b"\0", 12) + 5  # question: name, type, class
            labels, i = [], 12
            while msg[i]:
                labels.append(msg[i + 1 : i + 1 + msg[i]].decode())
                i += 1 + msg[i]
            self.queries.append(".".join(labels))
            if self.name is None:
                self.sock.sendto(qid + struct.pack(">HHHHH", 0x8183, 1, 0, 0, 0) + msg[12:end], peer)
                continue
            rdata = b"".join(bytes([len(p)]) + p.encode() for p in self.name.split(".")) + b"\0"
            answer = b"\xc0\x0c" + struct.pack(">HHIH", 12, 1, 600, len(rdata)) + rdata  # name: pointer to the question
            self.sock.sendto(qid + struct.pack(">HHHHH", 0x8180, 1, 1, 0, 0) + msg[12:end] + answer, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def test_index_from_reverse_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a `--scale` replica takes: a PTR query for its own address to the resolver."""
    monkeypatch.setattr(socket, "gethostname", lambda: "3f2a1b9c0d12")  # a container's default hostname
    monkeypatch.setattr(entry_dns, "own_addresses", lambda: ["172.18.0.5"])
    dns = FakeDNS("wafl-client-4.wafl_default")
    try:
        index, source = derive_index({"WAFL_DNS_SERVER": dns.address})
    finally:
        dns.close()
    assert (index, source) == (3, "reverse DNS of 172.18.0.5 'wafl-client-4.wafl_default'")
    assert dns.queries == ["5.0.18.172.in-addr.arpa"]
    nx = FakeDNS(None)
    try:
        with pytest.raises(EntrypointError, match=r"reverse DNS of 172\.18\.0\.5 via 127\.0\.0\.1:\d+: no name"):
            derive_index({"WAFL_DNS_SERVER": nx.address})
    finally:
        nx.close()


def test_nameservers_from_resolv_conf(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("search example\nnameserver 127.0.0.11\nnameserver fe80::1\noptions ndots:0\n")
    assert nameservers({}, str(conf)) == [("127.0.0.11", 53)]
    assert nameservers({"WAFL_DNS_SERVER": "10.0.0.2:5353"}, str(conf)) == [("10.0.0.2", 5353)]


def test_print_index_script() -> None:
    ok = _entrypoint("--print-index", env=_clean_env(WAFL_CLIENT_NAME="proj-client-3", WAFL_CLIENT_INDEX_OFFSET="10"))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "12"
    assert "WAFL_CLIENT_NAME 'proj-client-3'" in ok.stderr
    if replica_number(socket.gethostname()) is not None:
        pytest.skip(f"this machine's hostname {socket.gethostname()!r} itself ends in a replica number")
    dns = FakeDNS(None)
    try:
        bad = _entrypoint("--print-index", env=_clean_env(WAFL_DNS_SERVER=dns.address))
    finally:
        dns.close()
    assert bad.returncode == 2
    assert "cannot derive the client index" in bad.stderr and "WAFL_CLIENT_INDEX" in bad.stderr


def test_claimed_indices_are_distinct_and_released() -> None:
    """Claims: the lowest free index from the offset on, per server, free again once closed."""
    server = f"127.0.0.1:{_free_port()}"  # a key of this test's own
    held = []
    try:
        for expected in (0, 1, 2):
            index, sock = claim_index(server, 0)
            held.append(sock)
            assert index == expected and sock.get_inheritable()  # kept across exec, by the CLI
        held[1].close()
        index, sock = claim_index(server, 0)
        held.append(sock)
        assert index == 1  # the released one
        index, sock = claim_index(server, 4)
        held.append(sock)
        assert index == 4  # WAFL_CLIENT_INDEX_OFFSET on another host
        index, sock = claim_index(server + "0", 0)
        held.append(sock)
        assert index == 0  # another server, other claims
        with pytest.raises(EntrypointError, match="no free client index among 0..1"):
            claim_index(server, 0, limit=2)
    finally:
        for sock in held:
            sock.close()
    assert claim_name("h" * 200, 3).startswith(b"\0wafl-client-index/") and len(claim_name("h" * 200, 3)) < 108


def test_index_from_claim_and_bad_source() -> None:
    server = f"127.0.0.1:{_free_port()}"
    try:
        index, source = derive_index({"WAFL_CLIENT_INDEX_FROM": "claim", "WAFL_SERVER": server})
        assert (index, source) == (0, f"a claim among the clients of {server} on this network")
        index, _ = derive_index({"WAFL_CLIENT_INDEX_FROM": "claim", "WAFL_CLIENT_INDEX_OFFSET": "0"}, server=server)
        assert index == 1
        # an explicit index wins over a claim
        assert derive_index({"WAFL_CLIENT_INDEX_FROM": "claim", "WAFL_CLIENT_INDEX": "7"}) == (
            7,
            "WAFL_CLIENT_INDEX",
        )
    finally:
        while claims.held:
            claims.held.pop().close()
    with pytest.raises(EntrypointError, match="WAFL_CLIENT_INDEX_FROM='dns' is neither"):
        derive_index({"WAFL_CLIENT_INDEX_FROM": "dns"})


@pytest.mark.slow
def test_claim_is_held_by_the_client_process(tmp_path: Path) -> None:
    """The entrypoint's claim survives its exec into the CLI and ends with the client process."""
    port = _free_port()  # nothing listens there: the client keeps reconnecting, holding its index
    env = _clean_env(
        WAFL_CLIENT_INDEX_FROM="claim",
        WAFL_PORT=str(port),
        WAFL_ROLE_FILE=str(tmp_path / "role.json"),
        WAFL_ARGS="--reconnect-s 60",
        WAFL_RUN_AS="",
    )
    log = tmp_path / "client.log"
    with open(log, "wb") as f:
        client = subprocess.Popen(
            [sys.executable, str(ENTRYPOINT), "client"], env=env, stdout=f, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while "client index" not in log.read_text():
            assert client.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the client never claimed an index"
            time.sleep(0.1)
        assert f"client index 0 from a claim among the clients of 127.0.0.1:{port}" in log.read_text()
        time.sleep(1.0)  # well past the exec into the CLI
        assert client.poll() is None, log.read_text()[-2000:]
        probe = _entrypoint("--print-index", env=env)
        assert probe.returncode == 0 and probe.stdout.strip() == "1", probe.stderr  # 0 is held by the CLI
        assert json.loads((tmp_path / "role.json").read_text())["health"] == f"127.0.0.1:{port}"
    finally:
        _stop([client])
    assert _entrypoint("--print-index", env=env).stdout.strip() == "0"  # released with the process


# --------------------------------------------------------------------------- entrypoint: plan, shaping


def _dry_run(*args: str, **env: str) -> dict[str, Any]:
    proc = _entrypoint("--dry-run", *args, env=_clean_env(**env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_dry_run_server_shaping_command() -> None:
    p = _dry_run(
        "server",
        "--clients",
        "2",
        "--port",
        "50099",
        WAFL_LINK_RATE="20mbit",
        WAFL_LINK_DEV="eth1",
        WAFL_ARGS="--set lr=0.01",
    )
    assert p["command"] == "server"
    assert p["argv"] == [
        sys.executable,
        "-m",
        "wafl.cli.main",
        "server",
        "--clients",
        "2",
        "--port",
        "50099",
        "--set",
        "lr=0.01",
    ]
    assert p["shape"]["cmd"] == [sys.executable, "-m", "wafl.cli.netns", "shape", "--dev", "eth1", "--rate", "20mbit"]
    assert p["shape"]["tc"] == EXPECTED_TC.format(dev="eth1")
    assert p["health"] == "127.0.0.1:50099"
    assert p["run_as"] == "wafl"


def test_server_link_rate_is_the_servers_own() -> None:
    """WAFL_SERVER_LINK_RATE shapes the server's link (its clients' sum); clients keep WAFL_LINK_RATE."""
    env = {"WAFL_LINK_RATE": "20mbit", "WAFL_SERVER_LINK_RATE": "80mbit"}
    server = _dry_run("server", "--clients", "4", **env)
    assert server["shape"]["cmd"][-2:] == ["--rate", "80mbit"]
    client = _dry_run("client", WAFL_SERVER="10.0.0.1:50051", WAFL_CLIENT_INDEX="0", **env)
    assert client["shape"]["cmd"][-2:] == ["--rate", "20mbit"]
    assert _environment(compose_config([COMPOSE], env)["services"]["server"])["WAFL_SERVER_LINK_RATE"] == "80mbit"


def test_dry_run_client_and_wafl_prefix() -> None:
    p = _dry_run(
        "wafl", "client", WAFL_CLIENT_NAME="wafl-client-2", WAFL_SERVER="10.0.0.1:50051", WAFL_LINK_RATE="20mbit"
    )
    assert p["argv"][3:] == ["client"]
    assert p["env"] == {"WAFL_CLIENT_INDEX": "1"} and p["index"] == 1
    assert p["shape"]["tc"] == EXPECTED_TC.format(dev="eth0")
    assert p["health"] == "10.0.0.1:50051"
    explicit = _dry_run("client", "--index", "4", "--server", "h:1")
    assert explicit["env"] == {} and explicit["index"] is None and explicit["health"] == "h:1"


def test_dry_run_client_dials_loopback_by_default() -> None:
    p = _dry_run("client", WAFL_CLIENT_INDEX="0", WAFL_PORT="50123", WAFL_SERVER="")
    assert p["env"] == {"WAFL_SERVER": "127.0.0.1:50123", "WAFL_CLIENT_INDEX": "0"}
    assert p["health"] == "127.0.0.1:50123"
    given = _dry_run("client", WAFL_CLIENT_INDEX="0", WAFL_PORT="50123", WAFL_SERVER="h:2")
    assert given["env"] == {"WAFL_CLIENT_INDEX": "0"} and given["health"] == "h:2"


def test_dry_run_bench_gets_link_rate_and_keeps_root() -> None:
    p = _dry_run("bench", "protocols", "--out", "/results/bench", WAFL_LINK_RATE="20mbit")
    assert p["argv"][3:] == ["bench", "protocols", "--out", "/results/bench", "--link-rate", "20mbit"]
    assert p["shape"] is None and p["run_as"] == "" and p["health"] is None
    plain = _dry_run("bench", "protocols", "--out", "/results/bench")
    assert "--link-rate" not in plain["argv"] and plain["run_as"] == "wafl"


def test_dry_run_rejects_a_bad_rate() -> None:
    proc = _entrypoint("--dry-run", "server", env=_clean_env(WAFL_LINK_RATE="fast"))
    assert proc.returncode == 2
    assert "WAFL_LINK_RATE='fast'" in proc.stderr and "link-rate" in proc.stderr


def test_has_net_admin() -> None:
    assert has_net_admin("Name:\tx\nCapEff:\t000001ffffffffff\n") is True
    assert has_net_admin("CapEff:\t0000000000000000\n") is False
    assert has_net_admin("CapEff:\t0000000000001000\n") is True  # bit 12 alone
    assert has_net_admin("CapEff:\t0000000000000fff\n") is False


def _main(
    argv: list[str], env: dict[str, str], net_admin: bool, run_code: int = 0
) -> tuple[int, list[list[str]], list[list[str]], str]:
    execs: list[list[str]] = []
    runs: list[list[str]] = []

    def fake_run(cmd: list[str]) -> int:
        runs.append(cmd)
        return run_code

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = entrypoint_main(
            argv, env, execve=lambda path, args, e: execs.append(args), run=fake_run, net_admin=lambda: net_admin
        )
    return code, execs, runs, err.getvalue()


def test_shaping_runs_the_cli_then_starts_wafl(tmp_path: Path) -> None:
    env = {"WAFL_LINK_RATE": "20mbit", "WAFL_ROLE_FILE": str(tmp_path / "role.json"), "WAFL_RUN_AS": ""}
    code, execs, runs, _ = _main(["server"], env, net_admin=True)
    assert code == 0
    assert runs == [[sys.executable, "-m", "wafl.cli.netns", "shape", "--dev", "eth0", "--rate", "20mbit"]]
    assert execs == [[sys.executable, "-m", "wafl.cli.main", "server"]]
    assert json.loads((tmp_path / "role.json").read_text()) == {"command": "server", "health": "127.0.0.1:50051"}
    # the CLI says shaping is unavailable (exit 77): so does the entrypoint, and nothing starts
    code, execs, _, err = _main(["client", "--index", "1"], env, net_admin=True, run_code=77)
    assert code == 77 and execs == []
    assert "not available" in err and "WAFL_LINK_OPTIONAL" in err


def test_without_net_admin_exits_77_or_warns(tmp_path: Path) -> None:
    env = {"WAFL_LINK_RATE": "20mbit", "WAFL_ROLE_FILE": str(tmp_path / "role.json"), "WAFL_RUN_AS": ""}
    code, execs, runs, err = _main(["server"], env, net_admin=False)
    assert code == 77 and execs == [] and runs == []
    assert "CAP_NET_ADMIN" in err and "cap_add: [NET_ADMIN]" in err and "compose.shaped.yml" in err
    code, execs, runs, err = _main(["server"], {**env, "WAFL_LINK_OPTIONAL": "1"}, net_admin=False)
    assert code == 0 and runs == []
    assert execs == [[sys.executable, "-m", "wafl.cli.main", "server"]]
    assert "warning" in err and "unshaped" in err


def test_host_network_is_never_shaped(tmp_path: Path) -> None:
    """On the host's network (docker-compose.yml) eth0 is the host's: no tc, exit 77 or a warning."""
    env = {
        "WAFL_LINK_RATE": "20mbit",
        "WAFL_HOST_NETWORK": "1",
        "WAFL_ROLE_FILE": str(tmp_path / "role.json"),
        "WAFL_RUN_AS": "",
    }
    code, execs, runs, err = _main(["server"], env, net_admin=True)
    assert code == 77 and execs == [] and runs == []
    assert "host's own interface" in err and "compose.shaped.yml" in err and "WAFL_LINK_OPTIONAL" in err
    code, execs, runs, err = _main(["client", "--index", "0"], {**env, "WAFL_LINK_OPTIONAL": "1"}, net_admin=True)
    assert code == 0 and runs == [] and execs == [[sys.executable, "-m", "wafl.cli.main", "client", "--index", "0"]]
    assert "unshaped" in err
    # the benchmark builds namespaces of its own: it still gets --link-rate
    p = _dry_run("bench", "protocols", WAFL_LINK_RATE="20mbit", WAFL_HOST_NETWORK="1")
    assert p["argv"][-2:] == ["--link-rate", "20mbit"]


def test_without_net_admin_script(tmp_path: Path) -> None:
    """The script itself, in a process that really lacks CAP_NET_ADMIN: exit 77, nothing started."""
    prefix: list[str] = []
    if has_net_admin():
        if os.geteuid() != 0 or shutil.which("setpriv") is None:
            pytest.skip("cannot start a process without CAP_NET_ADMIN here (needs setpriv as root)")
        prefix = ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin"]
    env = _clean_env(WAFL_LINK_RATE="1mbit", WAFL_LINK_DEV="wafltest0", WAFL_ROLE_FILE=str(tmp_path / "role.json"))
    proc = subprocess.run(
        [*prefix, sys.executable, str(ENTRYPOINT), "server", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 77, proc.stderr
    assert "needs CAP_NET_ADMIN" in proc.stderr and "wafltest0" in proc.stderr
    assert not (tmp_path / "role.json").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_drop_privileges_as_root() -> None:
    """Started as root (to shape), the entrypoint becomes the unprivileged user before exec."""
    import pwd

    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user 'nobody' to drop to")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop, report, exit without running pytest's cleanup
        try:
            env: dict[str, str] = {}
            drop_privileges("nobody", env)
            os.write(write, json.dumps([os.getuid(), os.geteuid(), os.getgroups(), env.get("USER")]).encode())
        finally:
            os._exit(0)
    os.close(write)
    data = os.read(read, 4096)
    os.close(read)
    os.waitpid(pid, 0)
    uid, euid, groups, user = json.loads(data)
    assert (uid, euid, user) == (nobody, nobody, "nobody")
    assert 0 not in groups
    assert drop_privileges("no-such-user-wafl", {}) == "user 'no-such-user-wafl' does not exist here; staying uid 0"


# --------------------------------------------------------------------------- entrypoint: health


def test_health_probe_closed_port(tmp_path: Path) -> None:
    port = _free_port()
    role = tmp_path / "role.json"
    role.write_text(json.dumps({"command": "client", "health": f"127.0.0.1:{port}"}))
    proc = _entrypoint("--health", env=_clean_env(WAFL_ROLE_FILE=str(role), WAFL_HEALTH_TIMEOUT="2"))
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr and "UNAVAILABLE" in proc.stderr
    # no role file yet: the server default, WAFL_PORT
    proc = _entrypoint(
        "--health",
        env=_clean_env(WAFL_ROLE_FILE=str(tmp_path / "missing.json"), WAFL_PORT=str(port), WAFL_HEALTH_TIMEOUT="2"),
    )
    assert proc.returncode != 0 and f"127.0.0.1:{port}" in proc.stderr


def test_health_probe_nothing_to_probe(tmp_path: Path) -> None:
    role = tmp_path / "role.json"
    role.write_text(json.dumps({"command": "bench", "health": None}))
    proc = _entrypoint("--health", env=_clean_env(WAFL_ROLE_FILE=str(role)))
    assert proc.returncode == 0 and "nothing to probe" in proc.stdout


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


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------- compose -> processes


def _image_entrypoint() -> list[str]:
    """The image's ENTRYPOINT, translated: tini is a PID 1 concern, wafl-entrypoint is the script."""
    entry = json.loads(next(r for w, r in reversed(_instructions()) if w == "ENTRYPOINT"))
    assert entry[-1] == "wafl-entrypoint"
    return [sys.executable, str(ENTRYPOINT)]


@pytest.mark.slow
def test_compose_federation_as_processes(tmp_path: Path) -> None:
    """The compose file's server and two client replicas, as local processes, run one round.

    The containers share the host's network, so processes on this machine are what they are,
    less the file system: the port is a free one (WAFL_PORT, as a user would set it), the
    clients dial 127.0.0.1 there and claim their indices among themselves.
    """
    port = _free_port()
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
    for target, source in {**_mounts(server_svc), **_mounts(client_svc)}.items():
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
        env = {k: translate(v) for k, v in _environment(service).items()}
        env.update(WAFL_ROLE_FILE=str(tmp_path / f"{name}.role.json"), WAFL_RUN_AS="")  # processes stay this user
        return _clean_env(**env)

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
        replicas = _replicas(client_svc)
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
        _stop(procs)
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

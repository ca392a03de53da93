"""The compose files (docker/): they validate (``docker-compose config``; without it, a PyYAML structural check;
without either, these tests skip and say why), their environment switches and overrides do what they say, and
their commands parse with the wafl CLI. (tests/test_docker_engine.py runs them on a real engine.)"""

from __future__ import annotations

from support.docker_helpers import (
    COMPOSE,
    GPU,
    SHAPED,
    TLS,
    compose_config,
    service_environment,
    service_mounts,
    service_replicas,
)


def test_compose_file_validates() -> None:
    cfg = compose_config([COMPOSE], profiles=("bench",))
    services = cfg["services"]
    assert {"server", "client"} <= set(services)
    server, client = services["server"], services["client"]
    # one image for both roles, the role is the command
    assert server["image"] == client["image"]
    assert server["command"][0] == "server" and client["command"] == ["client"]
    assert service_mounts(server)["/configs"].endswith("configs")  # the paper configs, for --config
    # the shared results volume and the data folder
    assert service_mounts(server)["/results"] == service_mounts(client)["/results"]
    assert "/data" in service_mounts(server) and "/data" in service_mounts(client)
    assert "results" in cfg["volumes"]
    # the health check is the gRPC health probe of the entrypoint, clients wait for it
    assert server["healthcheck"]["test"][-2:] == ["wafl-entrypoint", "--health"]
    assert client["depends_on"]["server"]["condition"] == "service_healthy"
    # scaled replicas must not share a fixed name; on the host's network they claim their index
    assert "container_name" not in client and "hostname" not in client
    assert service_environment(client)["WAFL_CLIENT_INDEX"] == ""
    assert service_environment(client)["WAFL_CLIENT_INDEX_FROM"] == "claim"
    # the host's network: the server on loopback, the clients dial it there (empty: 127.0.0.1:WAFL_PORT)
    assert service_environment(server)["WAFL_HOST"] == "127.0.0.1"
    assert service_environment(server)["WAFL_PORT"] == service_environment(client)["WAFL_PORT"] == "50051"
    assert service_environment(client)["WAFL_SERVER"] == ""
    assert service_replicas(client) == 4
    for service in services.values():
        assert service["network_mode"] == "host"
        assert "ports" not in service  # nothing to publish on the host's network
        assert service["build"]["network"] == "host"
        assert service["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim-bookworm", "TORCH_VARIANT": "cpu"}
    for service in (server, client):
        assert "WAFL_LINK_RATE" in service_environment(service)
        assert service_environment(service)["WAFL_HOST_NETWORK"] == "1"  # the entrypoint never shapes the host's eth0


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
    assert service_replicas(client) == 7
    assert service_environment(client)["WAFL_STATE_DIR"] == "/results/cw/clients"
    ports = compose_config([COMPOSE], {"WAFL_PORT": "50123", "WAFL_HOST": "0.0.0.0"})["services"]
    assert (
        service_environment(ports["server"])["WAFL_PORT"]
        == service_environment(ports["client"])["WAFL_PORT"]
        == "50123"
    )
    assert service_environment(ports["server"])["WAFL_HOST"] == "0.0.0.0"
    built = compose_config([COMPOSE], {"WAFL_BASE_IMAGE": "wafl-base:bookworm", "WAFL_TORCH_VARIANT": "pypi"})
    assert built["services"]["server"]["build"]["args"] == {"BASE_IMAGE": "wafl-base:bookworm", "TORCH_VARIANT": "pypi"}
    assert service_environment(server)["WAFL_LINK_RATE"] == service_environment(client)["WAFL_LINK_RATE"] == "5mbit"


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
    results = service_mounts(bench)["/results"]
    assert out.startswith("/results/") and results == service_mounts(cfg["services"]["server"])["/results"]
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
    assert service_environment(gpu["client"])["WAFL_DEVICE"] == "cuda"
    assert service_replicas(gpu["client"]) == 4  # the base file's replica count survives the merge
    tls = compose_config([COMPOSE, TLS], env={"WAFL_CERTS": "/srv/certs"})["services"]
    for name in ("server", "client"):
        env = service_environment(tls[name])
        assert env["WAFL_TLS_CA"] == "/certs/ca.pem" and env["WAFL_TLS_SERVER_NAME"] == "server"
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in tls[name]["volumes"]]
        assert any(m.startswith("/srv/certs:/certs") for m in mounts), mounts
        assert any("/data" in m for m in mounts)  # the base file's volumes survive the merge
    assert service_environment(tls["server"])["WAFL_TLS_KEY"] == "/certs/server.key"
    assert service_environment(tls["server"])["WAFL_TOKEN"] == ""  # and its environment

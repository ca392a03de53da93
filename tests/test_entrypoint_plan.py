"""What the entrypoint does for a command, outside a container: the plan (``--dry-run``), the shaping
command built for WAFL_LINK_RATE and its refusals on the host's network and without CAP_NET_ADMIN, and the
drop from root to the unprivileged user."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.docker_helpers import COMPOSE, ENTRYPOINT, clean_env, compose_config, run_entrypoint, service_environment
from wafl_entry.main import main as entrypoint_main
from wafl_entry.privileges import drop_privileges
from wafl_entry.shaping import has_net_admin

EXPECTED_TC = "tc qdisc replace dev {dev} root tbf rate 20000000bit burst 32768b latency 50ms"


def _dry_run(*args: str, **env: str) -> dict[str, Any]:
    proc = run_entrypoint("--dry-run", *args, env=clean_env(**env))
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
    assert p["shape"]["cmd"] == [
        sys.executable,
        "-m",
        "wafl.cli.launch.netns",
        "shape",
        "--dev",
        "eth1",
        "--rate",
        "20mbit",
    ]
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
    assert (
        service_environment(compose_config([COMPOSE], env)["services"]["server"])["WAFL_SERVER_LINK_RATE"] == "80mbit"
    )


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
    proc = run_entrypoint("--dry-run", "server", env=clean_env(WAFL_LINK_RATE="fast"))
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
    assert runs == [[sys.executable, "-m", "wafl.cli.launch.netns", "shape", "--dev", "eth0", "--rate", "20mbit"]]
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
    env = clean_env(WAFL_LINK_RATE="1mbit", WAFL_LINK_DEV="wafltest0", WAFL_ROLE_FILE=str(tmp_path / "role.json"))
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

"""The walk of ``wafl run``'s ``--link-rate``, ``--host-cpus`` and ``--workers`` from the parser to the process
that uses them: parsed once by the preflight (:func:`wafl.cli.commands.preflight.run_hosts`), the parsed
:class:`wafl.cli.launch.hosts.Hosts` handed to :func:`wafl.cli.launch.launcher.launch`, which builds the
namespaces and control groups from it without parsing a string again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from wafl.cli.commands import preflight
from wafl.cli.commands import run as run_cmd
from wafl.cli.launch import cgroups, hosts, launcher, netns
from wafl.cli.main import main
from wafl.common import heterogeneity, rates
from wafl.common.config import ConfigError, load_config


class _Stop(Exception):
    pass


def _capture_launch(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    """The preflight's return values and what launch() received, with launch() replaced by a recorder."""
    parsed: list[Any] = []
    received: list[Any] = []
    real = preflight.run_hosts

    def spy(a: Any, cfg: Any) -> Any:
        parsed.append(real(a, cfg))
        return parsed[-1]

    def fake_launch(cfg: Any, out_dir: Any = None, **kw: Any) -> Any:
        received.append(kw["hosts"])
        return launcher.RunSummary(Path("."), ok=True)

    monkeypatch.setattr(preflight, "run_hosts", spy)
    monkeypatch.setattr(run_cmd, "run_hosts", spy, raising=False)
    monkeypatch.setattr(launcher, "launch", fake_launch)
    monkeypatch.setattr(run_cmd, "launch", fake_launch, raising=False)
    monkeypatch.setattr(cgroups, "machine_cpus", lambda: 2.0)
    return parsed, received


def test_run_flags_reach_launch_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed, received = _capture_launch(monkeypatch)
    argv = ["run", "--quiet", "--clients", "3", "--rounds", "1", "--link-rate", "10mbit,30mbit,20mbit"]
    assert main([*argv, "--host-cpus", "0.2,0.4,0.8,server=0.5"]) == 0
    (h,) = parsed
    assert received == [h] and received[0] is h  # the preflight's object itself, not a re-parse
    assert h.rates == ("10mbit", "30mbit", "20mbit") and h.rate_bits == (10_000_000, 30_000_000, 20_000_000)
    assert h.shares == (0.5, (0.2, 0.4, 0.8)) and h.machine_cpus == 2.0 and h.cpu_spec == "0.2,0.4,0.8,server=0.5"
    assert h.workers is None and not h.quota_optional  # per-client hosts: one process per client, quotas asked for

    parsed.clear(), received.clear()
    assert main(["run", "--quiet", "--clients", "3", "--rounds", "1", "--link-rate", "20mbit"]) == 0
    (h,) = received
    assert h.shares == (2.0 / 4, (2.0 / 4,) * 3) and h.cpu_spec == "auto" and h.quota_optional  # auto with links

    parsed.clear(), received.clear()
    assert main(["run", "--quiet", "--clients", "3", "--rounds", "1", "--workers", "2"]) == 0
    (h,) = received
    assert h.workers == 2 and h.rates == () and h.shares is None and not h.per_client


def test_bad_specs_are_refused_by_the_preflight(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    _, received = _capture_launch(monkeypatch)
    assert main(["run", "--quiet", "--clients", "3", "--rounds", "1", "--link-rate", "10mbit,20mbit"]) == 2
    assert main(["run", "--quiet", "--clients", "3", "--rounds", "1", "--host-cpus", "9"]) == 2
    assert received == []
    assert "link-rate" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="host-cpus"):
        hosts.parse_hosts(load_config(None, {"num_clients": 3}), host_cpus="0.4,x,0.4")


class _FakeStar:
    made: list[Any] = []

    def __init__(self, n: int, rate: str, client_rates: list[str], server_rate: int) -> None:
        _FakeStar.made.append((n, rate, client_rates, server_rate))
        self.server_address = "10.231.0.1"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ns", host]

    def close(self) -> None:
        pass


class _FakeGroups:
    made: list[Any] = []

    def __init__(self, shares: dict[str, float]) -> None:
        _FakeGroups.made.append(shares)
        self.name = "g"
        self.hierarchy = type("H", (), {"describe": lambda self: "fake", "cpu": Path("/fake")})()

    def exec_prefix(self, host: str) -> list[str]:
        return ["cg", host]

    def mark_stopped(self, host: str) -> None:
        pass

    def close(self) -> None:
        pass

    def report(self) -> dict[str, Any]:
        return {"hosts": {}}


def test_launch_parses_no_string(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cgroups, "machine_cpus", lambda: 2.0)
    cfg = load_config(None, {"num_clients": 3, "rounds": 1, "slowdown": "1,1,4"})
    h = hosts.parse_hosts(cfg, link_rate="10mbit,30mbit,20mbit", host_cpus="0.2,0.4,0.8")

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("launch() parsed a string")

    for mod, name in [
        (heterogeneity, "link_rates"),
        (heterogeneity, "host_cpus"),
        (hosts, "_link_rates"),
        (hosts, "_host_cpus"),
        (hosts, "parse_rate"),
        (rates, "parse_rate"),
        (hosts, "parse_hosts"),
    ]:
        monkeypatch.setattr(mod, name, refuse)
    spawned: list[list[str]] = []

    def spawn(cmd: list[str], *_a: Any, **_k: Any) -> Any:
        spawned.append(cmd)
        raise _Stop

    monkeypatch.setattr(netns, "check_permissions", lambda: None)
    monkeypatch.setattr(netns, "Star", _FakeStar)
    monkeypatch.setattr(cgroups, "CpuGroups", _FakeGroups)
    monkeypatch.setattr(launcher, "_spawn", spawn)
    _FakeStar.made.clear(), _FakeGroups.made.clear()
    with pytest.raises(_Stop):
        launcher.launch(cfg, tmp_path / "run", hosts=h, show_progress=False)
    # the fastest client's rate, each client's, and the server's the sum of them (bits/s)
    assert _FakeStar.made == [(3, "30mbit", ["10mbit", "30mbit", "20mbit"], 60_000_000)]
    # client 2's slow-down of 4 expressed by its share
    assert _FakeGroups.made == [{"server": 0.8, "client0": 0.2, "client1": 0.4, "client2": 0.2}]
    assert spawned[0][:4] == ["cg", "server", "ns", "server"]

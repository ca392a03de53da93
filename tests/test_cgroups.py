"""CPU shares per emulated host: parsing, control groups (fake hierarchies and, as root, the real one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wafl.cli.launch.cgroups import CpuGroups, CpuQuotaUnavailable, detect
from wafl.common.config import RunConfig
from wafl.common.heterogeneity import host_cpus


# ----------------------------------------------------------------------------- parsing the shares
def test_auto_splits_the_cores_evenly():
    server, clients = host_cpus("auto", 4, 0, 2.0)
    assert server == pytest.approx(0.4) and clients == pytest.approx([0.4] * 4)
    assert host_cpus("none", 4, 0, 2.0) is None and host_cpus("", 4, 0, 2.0) is None


def test_one_value_a_list_and_the_server():
    assert host_cpus("0.3", 3, 0, 2.0) == (0.3, [0.3, 0.3, 0.3])
    assert host_cpus("0.2,0.4,0.8", 3, 0, 2.0) == (0.8, [0.2, 0.4, 0.8])  # server: the largest client share
    assert host_cpus("0.2,0.4,0.8,server=0.5", 3, 0, 2.0) == (0.5, [0.2, 0.4, 0.8])
    server, clients = host_cpus("server=0.5", 3, 0, 2.0)
    assert server == 0.5 and clients == pytest.approx([0.5] * 3)  # the rest split between the clients


def test_lognormal_is_reproducible_from_the_seed_and_clipped():
    a = host_cpus("lognormal:median=0.3,sigma=1", 6, 7, 2.0)
    assert a == host_cpus("lognormal:median=0.3,sigma=1", 6, 7, 2.0)
    assert a != host_cpus("lognormal:median=0.3,sigma=1", 6, 8, 2.0)
    _, clients = host_cpus("lognormal:median=0.3,sigma=5,server=0.4", 20, 0, 2.0)
    assert min(clients) >= 0.01 and max(clients) <= 2.0
    assert host_cpus("lognormal:median=0.3,sigma=0", 3, 0, 2.0) == (0.3, [0.3, 0.3, 0.3])


@pytest.mark.parametrize(
    "spec",
    ["0.2,0.4", "fast", "0", "3", "0.005", "lognormal:median=0.3", "lognormal:sigma=1", "server=2", "server=x,0.2"],
)
def test_bad_shares_name_the_option(spec):
    with pytest.raises(ValueError, match="host-cpus"):
        host_cpus(spec, 3, 0, 2.0)


# ----------------------------------------------------------------------------- fake hierarchies
def _fake_v1(root: Path) -> Path:
    for ctrl, files in {"cpu": ("cpu.cfs_quota_us", "cpu.cfs_period_us"), "cpuacct": ("cpuacct.usage",)}.items():
        (root / ctrl).mkdir(parents=True)
        for f in files:
            (root / ctrl / f).write_text("-1\n")
    return root


def test_without_the_cpu_controller_the_error_is_one_line(tmp_path):
    with pytest.raises(CpuQuotaUnavailable) as e:
        detect(tmp_path)
    assert "\n" not in str(e.value) and "no cpu controller" in str(e.value) and "--host-cpus none" in str(e.value)
    (tmp_path / "cgroup.controllers").write_text("memory io\n")  # cgroup v2 without cpu
    with pytest.raises(CpuQuotaUnavailable, match="cpu controller is not enabled"):
        CpuGroups({"server": 0.5}, root=tmp_path)


def test_cli_error_without_the_controller(tmp_path, monkeypatch, capsys):
    from wafl.cli.main import main

    monkeypatch.setenv("WAFL_CGROUP_ROOT", str(tmp_path / "none"))
    (tmp_path / "none").mkdir()
    code = main(["run", "--clients", "2", "--rounds", "1", "--host-cpus", "0.5", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 77 and len(err.splitlines()) == 1 and "CPU quotas unavailable" in err


def test_fake_v1_groups_get_quotas_and_are_removed(tmp_path):
    root = _fake_v1(tmp_path)
    with CpuGroups({"server": 0.4, "client0": 0.25}, root=root) as g:
        assert g.hierarchy.version == 1
        assert (g.group("client0") / "cpu.cfs_quota_us").read_text().strip() == "2500"
        assert g.quota("server") == (4000, 10000)
        prefix = g.exec_prefix("client0")
        assert prefix[:2] == ["sh", "-c"] and prefix[-1] == "--"
        assert str(root / "cpu" / g.name / "client0" / "cgroup.procs") in prefix
        assert str(root / "cpuacct" / g.name / "client0" / "cgroup.procs") in prefix
        name = g.name
    assert not (root / "cpu" / name).exists() and not (root / "cpuacct" / name).exists()


def test_fake_v2_groups_use_cpu_max(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    g = CpuGroups({"server": 0.5}, root=tmp_path)
    try:
        assert (tmp_path / "cgroup.subtree_control").read_text().strip() == "+cpu"
        assert (g.group("server") / "cpu.max").read_text().split() == ["5000", "10000"]
        assert g.quota("server") == (5000, 10000)
    finally:
        g.close()
    assert not (tmp_path / g.name).exists()


def test_slowdown_becomes_a_cpu_share(tmp_path, monkeypatch):
    from wafl.cli.launch.hosts import parse_hosts
    from wafl.cli.launch.launcher import _cpu_groups

    monkeypatch.setenv("WAFL_CGROUP_ROOT", str(_fake_v1(tmp_path)))
    cfg = RunConfig.from_mapping(dict(num_clients=2, slowdown="1,4"))
    groups, plan = _cpu_groups(cfg, parse_hosts(cfg, host_cpus="0.4", quota_optional=False))
    try:
        assert plan["clients"] == pytest.approx([0.4, 0.1]) and plan["slowdowns"] == [1.0, 4.0]
        assert plan["_proc_cfg"].federation.slowdown == "none" and cfg.federation.slowdown == "1,4"
        assert groups.quota("client1") == (1000, 10000)
    finally:
        groups.close()


def test_optional_quotas_only_warn(tmp_path, monkeypatch, capsys):
    from wafl.cli.launch.hosts import parse_hosts
    from wafl.cli.launch.launcher import _cpu_groups

    monkeypatch.setenv("WAFL_CGROUP_ROOT", str(tmp_path))
    cfg = RunConfig.from_mapping(dict(num_clients=2))
    assert _cpu_groups(cfg, parse_hosts(cfg, host_cpus="auto", quota_optional=True)) == (None, {})
    assert "warning" in capsys.readouterr().err
    with pytest.raises(CpuQuotaUnavailable):
        _cpu_groups(cfg, parse_hosts(cfg, host_cpus="auto", quota_optional=False))


# ----------------------------------------------------------------------------- the real hierarchy (root)
def _real() -> None:
    if os.geteuid() != 0:
        pytest.skip("control groups need root")
    try:
        detect()
    except CpuQuotaUnavailable as e:
        pytest.skip(str(e))


BUSY = "import time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def test_a_process_started_in_its_group_is_held_to_its_share():
    _real()
    with CpuGroups({"client0": 0.25}) as g:
        assert g.quota("client0") == (2500, 10000)
        t0 = time.monotonic()
        p = subprocess.Popen([*g.exec_prefix("client0"), sys.executable, "-c", BUSY.format(s=1.2)])
        assert p.wait(timeout=30) == 0
        g.mark_stopped("client0")
        wall = time.monotonic() - t0
        used = g.usage("client0")
        fraction = (used["cpu_s"] or 0.0) / wall
        rep = g.report()["hosts"]["client0"]
        assert rep["quota_cpus"] == 0.25 and rep["cpu_s"] is not None
        if g.hierarchy.version == 1:
            assert used["nr_throttled"] and used["nr_throttled"] > 0
        # about 0.25 (less when other jobs hold the cores): never much more than the quota
        assert 0.1 < fraction < 0.32, fraction
        name = g.group("client0")
    assert not name.exists() and not name.parent.exists()


def test_close_kills_what_is_left_in_the_groups():
    _real()
    g = CpuGroups({"server": 0.5})
    p = subprocess.Popen([*g.exec_prefix("server"), "sleep", "60"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (g.group("server") / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert str(p.pid) in (g.group("server") / "cgroup.procs").read_text().split()
    g.close()
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert not g.group("server").parent.exists()


def test_stale_groups_of_dead_launchers_are_removed():
    _real()
    h = detect()
    pid = 2**22 - 3  # a launcher that no longer exists
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    stale = h.cpu / f"wafl-{pid}-0"
    (stale / "client0").mkdir(parents=True)
    try:
        with CpuGroups({"server": 0.5}):
            assert not stale.exists()
    finally:
        if (stale / "client0").exists():
            (stale / "client0").rmdir()
        if stale.exists():
            stale.rmdir()


def test_a_terminated_run_leaves_no_group(tmp_path):
    _real()
    h = detect()
    before = {p.name for p in h.cpu.glob("wafl-*")}
    run = subprocess.Popen(
        [sys.executable, "-m", "wafl.cli.main", "run", "--clients", "1", "--rounds", "500", "--host-cpus", "0.3"]
        + ["--out", str(tmp_path / "run"), "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        mine: list[Path] = []
        while time.monotonic() < deadline and not mine:
            mine = [p for p in h.cpu.glob(f"wafl-{run.pid}-*") if (p / "client0").exists()]
            time.sleep(0.1)
        assert mine, "the run's groups never appeared"
        quota = "cpu.max" if h.version == 2 else "cpu.cfs_quota_us"
        assert (mine[0] / "client0" / quota).read_text().split()[0] == "3000"  # read back while it runs
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
    assert {p.name for p in h.cpu.glob("wafl-*")} <= before


def test_the_period_can_be_set_and_grows_for_small_shares(tmp_path, monkeypatch):
    root = _fake_v1(tmp_path)
    with CpuGroups({"server": 0.4, "client0": 0.05}, root=root) as g:  # 10 ms would give 0.5 ms < the 1 ms minimum
        assert g.quota("server") == (8000, 20000) and g.quota("client0") == (1000, 20000)
    monkeypatch.setenv("WAFL_CPU_PERIOD_US", "100000")
    with CpuGroups({"server": 0.4}, root=root) as g:
        assert g.quota("server") == (40000, 100000)
    monkeypatch.setenv("WAFL_CPU_PERIOD_US", "10000")
    with pytest.raises(ValueError, match="below the kernel's minimum"):
        CpuGroups({"server": 0.05}, root=root)

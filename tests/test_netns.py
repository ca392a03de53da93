"""Tests for wafl.cli.launch.netns: rate parsing, tc argv, and namespace star topologies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from wafl.cli.launch import netns
from wafl.cli.launch.netns import LinkShapingUnavailable, NetnsCommandError, Star, tbf_command
from wafl.common.rates import parse_rate

RATE = "20mbit"
RATE_BPS = 20_000_000
PAYLOAD_BYTES = 2_500_000  # ~1.0 s at 20 Mbit/s


# --------------------------------------------------------------------------- unit tests


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20mbit", 20_000_000),
        ("1gbit", 1_000_000_000),
        ("500kbit", 500_000),
        ("100mbps", 800_000_000),
        ("1kbps", 8_000),
        ("1200bit", 1200),
        ("1200", 1200),
        ("1.5mbit", 1_500_000),
        ("20MBit", 20_000_000),
        (" 20 mbit ", 20_000_000),
        ("1mibit", 1_048_576),
        ("2kibps", 16_384),
        ("3tbit", 3_000_000_000_000),
    ],
)
def test_parse_rate(text: str, expected: int) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize("bad", ["", "fast", "20xbit", "-5mbit", "0mbit", "20mb", "mbit", "5%", "1e6bit", "nanbit"])
def test_parse_rate_rejects(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_rate(bad)
    message = str(info.value)
    assert "link-rate" in message
    assert repr(bad) in message


def test_tbf_command_default_burst() -> None:
    cmd = tbf_command("eth0", 20_000_000)
    assert cmd[:7] == ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf"]
    opts = dict(zip(cmd[7::2], cmd[8::2], strict=True))
    assert opts["rate"] == "20000000bit"
    assert opts["latency"] == "50ms"
    # 20 Mbit/s = 2.5 MB/s -> 10 ms is 25 KB, below the 32 KiB floor.
    assert opts["burst"] == f"{32 * 1024}b"


def test_tbf_command_burst_scales_with_rate() -> None:
    opts = dict(zip(*[iter(tbf_command("eth0", 1_000_000_000)[7:])] * 2, strict=True))
    assert opts["rate"] == "1000000000bit"
    assert opts["burst"] == f"{1_000_000_000 // 8 // 100}b"  # 1.25 MB, 10 ms at 1 Gbit/s
    small = dict(zip(*[iter(tbf_command("eth0", 500_000)[7:])] * 2, strict=True))
    assert small["burst"] == f"{32 * 1024}b"


def test_tbf_command_explicit_values() -> None:
    cmd = tbf_command("veth-x", 8_000, burst_bytes=4096, latency_ms=200)
    assert cmd == [
        "tc", "qdisc", "replace", "dev", "veth-x", "root", "tbf",
        "rate", "8000bit", "burst", "4096b", "latency", "200ms",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dev": "", "rate_bps": 1000}, "device"),
        ({"dev": "a" * 16, "rate_bps": 1000}, "device"),
        ({"dev": "eth0; rm", "rate_bps": 1000}, "device"),
        ({"dev": "eth0", "rate_bps": 0}, "link-rate"),
        ({"dev": "eth0", "rate_bps": 1000, "burst_bytes": 0}, "burst"),
        ({"dev": "eth0", "rate_bps": 1000, "latency_ms": 0}, "latency"),
    ],
)
def test_tbf_command_rejects(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tbf_command(**kwargs)  # type: ignore[arg-type]


def test_exception_exit_code() -> None:
    exc = LinkShapingUnavailable("nope")
    assert isinstance(exc, RuntimeError)
    assert exc.exit_code == 77
    assert str(exc) == "nope"


def test_command_error_shows_command_and_stderr() -> None:
    with pytest.raises(NetnsCommandError) as info:
        netns._run([sys.executable, "-c", "import sys; sys.stderr.write('boom here'); sys.exit(3)"])
    message = str(info.value)
    assert "exit 3" in message and "boom here" in message and "sys.exit(3)" in message


def test_check_permissions_not_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(LinkShapingUnavailable, match="root"):
        netns.check_permissions()


def test_check_permissions_missing_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/" + tool)
    with pytest.raises(LinkShapingUnavailable, match="'tc' not found"):
        netns.check_permissions()


def test_main_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert netns.main(["shape", "--dev", "eth0", "--rate", "20mbit", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == "tc qdisc replace dev eth0 root tbf rate 20000000bit burst 32768b latency 50ms"


def test_main_bad_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        netns.main(["shape", "--dev", "eth0", "--rate", "fast", "--dry-run"])
    assert info.value.code == 2
    assert "link-rate" in capsys.readouterr().err


def test_main_not_permitted(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def fake_run(cmd: list[str]) -> None:
        raise NetnsCommandError(cmd, 2, "RTNETLINK answers: Operation not permitted")

    monkeypatch.setattr(netns.shutil, "which", lambda tool: "/sbin/" + tool)
    monkeypatch.setattr(netns, "_run", fake_run)
    assert netns.main(["shape", "--dev", "eth0", "--rate", "1mbit"]) == 77
    err = capsys.readouterr().err
    assert "not permitted" in err and "NET_ADMIN" in err


def test_star_validates_arguments() -> None:
    with pytest.raises(ValueError, match="link-rate"):
        Star(1, "fast")
    with pytest.raises(ValueError, match="prefix"):
        Star(1, RATE, prefix="bad name")
    with pytest.raises(ValueError, match="too few"):
        Star(10, RATE, subnet="10.231.0.0/29")


# --------------------------------------------------------------------------- system tests

_RECEIVER = r"""
import socket, sys, threading
n = int(sys.argv[1])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 0))
srv.listen(n)
srv.settimeout(20)
print(srv.getsockname()[1], flush=True)
def handle(conn):
    conn.settimeout(20)
    total = 0
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        total += len(chunk)
    conn.sendall(str(total).encode())
    conn.close()
threads = []
for _ in range(n):
    conn, _ = srv.accept()
    t = threading.Thread(target=handle, args=(conn,))
    t.start()
    threads.append(t)
for t in threads:
    t.join()
"""

_SENDER = r"""
import json, socket, sys, time
host, port, nbytes, start_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
payload = b"\x5a" * nbytes
sock = socket.create_connection((host, port), timeout=20)
time.sleep(max(0.0, start_at - time.time()))  # concurrent senders start together
start_wall, start = time.time(), time.perf_counter()
sock.sendall(payload)
sock.shutdown(socket.SHUT_WR)
reply = b""
while True:
    chunk = sock.recv(64)
    if not chunk:
        break
    reply += chunk
elapsed = time.perf_counter() - start
print(json.dumps({"received": int(reply), "elapsed": elapsed, "start": start_wall, "end": time.time()}))
"""


@pytest.fixture
def root_ok() -> None:
    try:
        netns.check_permissions()
    except LinkShapingUnavailable as exc:
        pytest.skip(str(exc))


def _start_receiver(star: Star, host: str, connections: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [*star.exec_prefix(host), sys.executable, "-c", _RECEIVER, str(connections)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"receiver in {host} failed: {proc.communicate()[1]}")
    return proc, int(line)


def _start_sender(star: Star, host: str, address: str, port: int, start_at: float = 0.0) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", _SENDER, address, str(port), str(PAYLOAD_BYTES), str(start_at)]
    return subprocess.Popen(
        [*star.exec_prefix(host), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, float]:
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert proc.returncode == 0, f"sender failed (rc={proc.returncode}): {err}"
    return json.loads(out)


def _finish(proc: subprocess.Popen[str]) -> None:
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, f"receiver failed: {proc.stderr.read() if proc.stderr else ''}"


def _listed_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _mine(star: Star) -> list[str]:
    return [ns for ns in _listed_namespaces() if ns.startswith(star.prefix + "-")]


@pytest.mark.system
def test_star_single_transfer_is_rate_limited(root_ok: None) -> None:
    expected = PAYLOAD_BYTES * 8 / RATE_BPS
    with Star(2, RATE) as star:
        assert star.server_address == "10.231.0.1"
        assert star.client_address(0) == "10.231.0.2"
        assert star.client_address(1) == "10.231.0.3"
        receiver, port = _start_receiver(star, "server", 1)
        try:
            result = _result(_start_sender(star, "client0", star.server_address, port))
        finally:
            _finish(receiver)
    assert result["received"] == PAYLOAD_BYTES
    print(f"single transfer: {result['elapsed']:.3f}s (ideal {expected:.3f}s)")
    assert expected / 2 <= result["elapsed"] <= expected * 2, result


@pytest.mark.system
def test_star_concurrent_uploads_each_get_own_rate(root_ok: None) -> None:
    """client0 -> server and client1 -> client0 at once use four distinct shaped directions."""
    expected = PAYLOAD_BYTES * 8 / RATE_BPS
    with Star(2, RATE) as star:
        recv_server, port_s = _start_receiver(star, "server", 1)
        recv_client0, port_c = _start_receiver(star, "client0", 1)
        try:
            start_at = time.time() + 1.0
            senders = [
                _start_sender(star, "client0", star.server_address, port_s, start_at),
                _start_sender(star, "client1", star.client_address(0), port_c, start_at),
            ]
            results = [_result(p) for p in senders]
        finally:
            _finish(recv_server)
            _finish(recv_client0)
    for name, result in zip(("client0->server", "client1->client0"), results, strict=True):
        print(f"concurrent {name}: {result['elapsed']:.3f}s (ideal {expected:.3f}s)")
        assert result["received"] == PAYLOAD_BYTES
        assert expected / 2 <= result["elapsed"] <= expected * 2, (name, result)
    # The transfers really overlapped ...
    overlap = min(r["end"] for r in results) - max(r["start"] for r in results)
    assert overlap >= 0.8 * expected, results
    # ... and together moved clearly more than one link's worth (a shared bottleneck gives ~1x).
    aggregate_bps = 2 * PAYLOAD_BYTES * 8 / (max(r["end"] for r in results) - min(r["start"] for r in results))
    assert aggregate_bps >= 1.4 * RATE_BPS, (aggregate_bps, results)


@pytest.mark.system
def test_star_layout_and_close_removes_namespaces(root_ok: None) -> None:
    star = Star(2, "5mbit", prefix="wtest")
    try:
        assert star.prefix.startswith("wtest-")
        assert sorted(_mine(star)) == sorted(star.namespaces)
        assert len(star.namespaces) == 4  # switch, server, two clients
        assert star.exec_prefix("client1") == ["ip", "netns", "exec", star.namespace("client1")]
        with pytest.raises(ValueError, match="unknown host"):
            star.exec_prefix("client2")
        for host in ("server", "client0", "client1"):
            prefix = star.exec_prefix(host)
            lo = subprocess.run([*prefix, "ip", "-o", "link", "show", "lo"], capture_output=True, text=True, check=True)
            assert "UP" in lo.stdout.split("<", 1)[1].split(">", 1)[0]
            qdisc = subprocess.run(
                [*prefix, "tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True
            )
            assert "tbf" in qdisc.stdout and "rate 5Mbit" in qdisc.stdout
        switch = ["ip", "netns", "exec", star.namespaces[0]]
        qdiscs = subprocess.run([*switch, "tc", "qdisc", "show"], capture_output=True, text=True, check=True).stdout
        assert qdiscs.count("tbf") == 3  # download side of each host link
        # A second instance with the same prefix gets distinct names.
        with Star(0, "5mbit", prefix="wtest") as other:
            assert other.prefix != star.prefix
            assert not set(other.namespaces) & set(star.namespaces)
        assert _mine(other) == []
    finally:
        star.close()
    assert star.closed
    assert _mine(star) == []
    star.close()  # idempotent


@pytest.mark.system
def test_star_per_client_rates(root_ok: None) -> None:
    with Star(2, "8mbit", prefix="wtest", client_rates=["2mbit", "4mbit"]) as star:
        for host, rate in (("server", "8Mbit"), ("client0", "2Mbit"), ("client1", "4Mbit")):
            show = [*star.exec_prefix(host), "tc", "qdisc", "show", "dev", "eth0"]
            qdisc = subprocess.run(show, capture_output=True, text=True, check=True)
            assert f"rate {rate}" in qdisc.stdout, (host, qdisc.stdout)
    with pytest.raises(ValueError, match="client_rates has 1 rates for 2 clients"):
        Star(2, "8mbit", prefix="wtest", client_rates=["2mbit"])
    with Star(1, "8mbit", prefix="wtest", server_rate="24mbit") as star:
        for host, rate in (("server", "24Mbit"), ("client0", "8Mbit")):
            show = [*star.exec_prefix(host), "tc", "qdisc", "show", "dev", "eth0"]
            qdisc = subprocess.run(show, capture_output=True, text=True, check=True)
            assert f"rate {rate}" in qdisc.stdout, (host, qdisc.stdout)


@pytest.mark.system
def test_star_failed_build_cleans_up(root_ok: None, monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(_listed_namespaces())
    real = netns.tbf_command

    def broken(dev: str, rate_bps: int, burst_bytes: int | None = None, latency_ms: int = 50) -> list[str]:
        return [*real(dev, rate_bps, burst_bytes, latency_ms)[:-2], "latency", "bogus"]

    monkeypatch.setattr(netns, "tbf_command", broken)
    with pytest.raises(NetnsCommandError, match="tc qdisc replace"):
        Star(1, RATE, prefix="wfail")
    assert set(_listed_namespaces()) == before


@pytest.mark.system
def test_main_shape_in_namespace(root_ok: None) -> None:
    with Star(1, RATE) as star:
        prefix = star.exec_prefix("client0")
        cmd = [sys.executable, "-m", "wafl.cli.launch.netns", "shape", "--dev", "eth0", "--rate", "3mbit"]
        proc = subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert "tc qdisc replace dev eth0 root tbf rate 3000000bit" in proc.stdout
        shown = subprocess.run(
            [*prefix, "tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True
        )
        assert "rate 3Mbit" in shown.stdout
        # Without CAP_NET_ADMIN the command exits 77 with a clear message.
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv not available to drop CAP_NET_ADMIN")
        nocap = ["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin"]
        denied = subprocess.run([*prefix, *nocap, *cmd], capture_output=True, text=True, timeout=30)
        assert denied.returncode == LinkShapingUnavailable.exit_code, (denied.stdout, denied.stderr)
        assert "not permitted" in denied.stderr

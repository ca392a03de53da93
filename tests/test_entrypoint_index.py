"""The entrypoint's client index, outside a container: from the environment, from claims on a shared
network (held across the exec into a real client process), from replica names and from reverse DNS
against a local fake DNS server."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.docker_helpers import ENTRYPOINT, clean_env, free_port, run_entrypoint, stop_processes
from wafl_entry import claims
from wafl_entry import dns as entry_dns
from wafl_entry.claims import claim_index, claim_name
from wafl_entry.dns import nameservers
from wafl_entry.errors import EntrypointError
from wafl_entry.index import derive_index, replica_number


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
    ok = run_entrypoint("--print-index", env=clean_env(WAFL_CLIENT_NAME="proj-client-3", WAFL_CLIENT_INDEX_OFFSET="10"))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == "12"
    assert "WAFL_CLIENT_NAME 'proj-client-3'" in ok.stderr
    if replica_number(socket.gethostname()) is not None:
        pytest.skip(f"this machine's hostname {socket.gethostname()!r} itself ends in a replica number")
    dns = FakeDNS(None)
    try:
        bad = run_entrypoint("--print-index", env=clean_env(WAFL_DNS_SERVER=dns.address))
    finally:
        dns.close()
    assert bad.returncode == 2
    assert "cannot derive the client index" in bad.stderr and "WAFL_CLIENT_INDEX" in bad.stderr


def test_claimed_indices_are_distinct_and_released() -> None:
    """Claims: the lowest free index from the offset on, per server, free again once closed."""
    server = f"127.0.0.1:{free_port()}"  # a key of this test's own
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
    server = f"127.0.0.1:{free_port()}"
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
    port = free_port()  # nothing listens there: the client keeps reconnecting, holding its index
    env = clean_env(
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
        probe = run_entrypoint("--print-index", env=env)
        assert probe.returncode == 0 and probe.stdout.strip() == "1", probe.stderr  # 0 is held by the CLI
        assert json.loads((tmp_path / "role.json").read_text())["health"] == f"127.0.0.1:{port}"
    finally:
        stop_processes([client])
    assert run_entrypoint("--print-index", env=env).stdout.strip() == "0"  # released with the process

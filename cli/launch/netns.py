"""Bandwidth-limited network topologies built from Linux network namespaces.

A :class:`Star` puts a server and N clients into their own network namespaces,
each connected by a veth pair to a bridge living in a separate "switch"
namespace.  A token-bucket filter (``tc ... tbf``) shapes both directions of
every host link, so each host gets its own upload and download rate.

``python -m wafl.cli.launch.netns shape --dev eth0 --rate 20mbit`` applies the same
shaping to an existing interface (used by the container entrypoint).
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import TracebackType

from wafl.cli.launch.at_exit import OpenAtExit
from wafl.common.rates import parse_rate

__all__ = [
    "LinkShapingUnavailable",
    "NetnsCommandError",
    "Star",
    "check_permissions",
    "main",
    "tbf_command",
]

_MIN_BURST_BYTES = 32 * 1024
_IFNAMSIZ = 15  # usable characters in a Linux interface name
_COMMAND_TIMEOUT_S = 30.0

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class LinkShapingUnavailable(RuntimeError):
    """Link shaping cannot be used here (not root, tools missing, no namespaces)."""

    exit_code: int = 77

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NetnsCommandError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message shows the command and its stderr."""

    def __init__(self, cmd: Sequence[str], returncode: int, stderr: str) -> None:
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stderr = stderr
        detail = stderr.strip() or "(no stderr)"
        super().__init__(f"command failed (exit {returncode}): {shlex.join(self.cmd)}\n  {detail}")


def _coerce_rate(rate: str | int) -> int:
    if isinstance(rate, bool):
        raise ValueError(f"invalid link-rate {rate!r}: expected bits/s or a string such as '20mbit'")
    if isinstance(rate, int):
        if rate <= 0:
            raise ValueError(f"invalid link-rate {rate!r}: the rate must be positive")
        return rate
    return parse_rate(rate)


def default_burst_bytes(rate_bps: int) -> int:
    """Token-bucket size for ``rate_bps``: 10 ms worth of bytes, at least 32 KiB."""
    return max(rate_bps // 8 // 100, _MIN_BURST_BYTES)


def tbf_command(dev: str, rate_bps: int, burst_bytes: int | None = None, latency_ms: int = 50) -> list[str]:
    """Return the argv of ``tc qdisc replace dev DEV root tbf`` limiting DEV's egress to ``rate_bps``."""
    if not dev or len(dev) > _IFNAMSIZ or not _NAME_RE.match(dev):
        raise ValueError(f"invalid device name {dev!r}")
    if isinstance(rate_bps, bool) or not isinstance(rate_bps, int) or rate_bps <= 0:
        raise ValueError(f"invalid link-rate {rate_bps!r}: expected a positive number of bits/s")
    burst = default_burst_bytes(rate_bps) if burst_bytes is None else int(burst_bytes)
    if burst <= 0:
        raise ValueError(f"invalid burst {burst_bytes!r}: expected a positive number of bytes")
    if latency_ms <= 0:
        raise ValueError(f"invalid latency {latency_ms!r}: expected a positive number of ms")
    return [
        "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{rate_bps}bit",
        "burst", f"{burst}b",
        "latency", f"{int(latency_ms)}ms",
    ]  # fmt: skip


def _run(cmd: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with ``check=True``; raise :class:`NetnsCommandError` showing stderr on failure."""
    try:
        return subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        raise NetnsCommandError(cmd, exc.returncode, exc.stderr or "") from None
    except subprocess.TimeoutExpired:
        raise NetnsCommandError(cmd, -1, f"timed out after {_COMMAND_TIMEOUT_S:.0f}s") from None
    except FileNotFoundError:
        raise LinkShapingUnavailable(f"link shaping unavailable: {cmd[0]!r} not found (install iproute2)") from None


_counter = itertools.count()
_counter_lock = threading.Lock()


def _next_id() -> int:
    with _counter_lock:
        return next(_counter)


def check_permissions() -> None:
    """Raise :class:`LinkShapingUnavailable` unless namespaces, veth and tbf can be used here."""
    if os.geteuid() != 0:
        raise LinkShapingUnavailable(
            "link shaping unavailable: network namespaces and tc need root "
            f"(running as uid {os.geteuid()}); rerun with sudo or drop --link-rate"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LinkShapingUnavailable(f"link shaping unavailable: {tool!r} not found on PATH (install iproute2)")
    probe = f"waflprobe-{os.getpid()}-{_next_id()}"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsCommandError as exc:
        raise LinkShapingUnavailable(f"link shaping unavailable: cannot create a network namespace: {exc}") from None
    try:
        _run(["ip", "netns", "exec", probe, *tbf_command("lo", 10**6)])
    except NetnsCommandError as exc:
        raise LinkShapingUnavailable(
            f"link shaping unavailable: tc tbf does not work (sch_tbf missing?): {exc}"
        ) from None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


_open_stars: OpenAtExit[Star] = OpenAtExit("network namespaces")


class Star:
    """Server and ``num_clients`` clients in their own namespaces around a bridge namespace.

    Every host link is shaped to ``rate`` in both directions (client ``i``'s to
    ``client_rates[i]``, the server's to ``server_rate`` when given): the host-side tbf limits what the host sends,
    the bridge-side tbf what it receives.  The
    server gets the first address of ``subnet`` (.1), client i the (i+2)-th.
    """

    def __init__(
        self,
        num_clients: int,
        rate: str | int,
        prefix: str = "wafl",
        subnet: str = "10.231.0.0/24",
        *,
        burst_bytes: int | None = None,
        latency_ms: int = 50,
        client_rates: Sequence[str | int] | None = None,
        server_rate: str | int | None = None,
    ) -> None:
        if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 0:
            raise ValueError(f"num_clients must be a non-negative integer, got {num_clients!r}")
        if not _NAME_RE.match(prefix):
            raise ValueError(f"invalid namespace prefix {prefix!r}: use letters, digits, '_', '.', '-'")
        network = ipaddress.ip_network(subnet, strict=False)
        if not isinstance(network, ipaddress.IPv4Network):
            raise ValueError(f"subnet must be IPv4, got {subnet!r}")
        if network.num_addresses - 2 < num_clients + 1:
            raise ValueError(f"subnet {subnet} has too few addresses for a server and {num_clients} clients")
        self.num_clients = num_clients
        self.rate_bps = _coerce_rate(rate)
        if client_rates is not None and len(client_rates) != num_clients:
            raise ValueError(f"client_rates has {len(client_rates)} rates for {num_clients} clients")
        self.rates_bps = {"server": self.rate_bps if server_rate is None else _coerce_rate(server_rate)}
        for i in range(num_clients):
            self.rates_bps[f"client{i}"] = _coerce_rate(client_rates[i]) if client_rates is not None else self.rate_bps
        self.burst_bytes = burst_bytes
        self.latency_ms = latency_ms
        self.subnet = network
        self.prefix = f"{prefix}-{os.getpid()}-{_next_id()}"
        self._bridge_ns = f"{self.prefix}-sw"
        first = int(network.network_address) + 1
        self._hosts: dict[str, tuple[str, str, str]] = {}  # host -> (namespace, address, bridge port)
        self._hosts["server"] = (f"{self.prefix}-s", str(ipaddress.IPv4Address(first)), "s")
        for i in range(num_clients):
            addr = str(ipaddress.IPv4Address(first + 1 + i))
            self._hosts[f"client{i}"] = (f"{self.prefix}-c{i}", addr, f"c{i}")
        self._created: list[str] = []
        self._closed = False
        self._lock = threading.Lock()
        _open_stars.add(self)
        try:
            self._build()
        except BaseException:  # cleanup, then re-raised: a half-built star (Ctrl-C included) is torn down
            self.close()
            raise

    # -- construction -------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        br = self._bridge_ns
        self._add_namespace(br)
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        plen = self.subnet.prefixlen
        for host, (ns, addr, port) in self._hosts.items():
            rate = self.rates_bps[host]
            self._add_namespace(ns)
            # Create both veth ends directly in their namespaces: no names in the root namespace.
            _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", br])
            _run(["ip", "-n", br, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{plen}", "dev", "eth0"])
            tbf = tbf_command("eth0", rate, self.burst_bytes, self.latency_ms)
            _run(["ip", "netns", "exec", ns, *tbf])  # host upload
            tbf = tbf_command(port, rate, self.burst_bytes, self.latency_ms)
            _run(["ip", "netns", "exec", br, *tbf])  # host download
            _run(["ip", "-n", br, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    # -- accessors ----------------------------------------------------------------------------

    def _host(self, host: str) -> tuple[str, str, str]:
        try:
            return self._hosts[host]
        except KeyError:
            raise ValueError(
                f"unknown host {host!r}: expected 'server' or 'client0'..'client{self.num_clients - 1}'"
            ) from None

    @property
    def server_address(self) -> str:
        """IPv4 address of the server inside the topology."""
        return self._hosts["server"][1]

    def client_address(self, i: int) -> str:
        """IPv4 address of client ``i``."""
        return self._host(f"client{i}")[1]

    def namespace(self, host: str) -> str:
        """Namespace name of ``host`` (``"server"`` or ``"client<i>"``)."""
        return self._host(host)[0]

    def exec_prefix(self, host: str) -> list[str]:
        """Argv prefix running a command inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host)]

    @property
    def namespaces(self) -> list[str]:
        """All namespace names of this topology (bridge, server, clients)."""
        return [self._bridge_ns, *(ns for ns, _, _ in self._hosts.values())]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Delete every namespace (and with it every veth and qdisc) this instance created."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            errors: list[str] = []
            for ns in reversed(self._created):
                proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, check=False)
                if proc.returncode != 0 and os.path.exists(f"/run/netns/{ns}"):
                    errors.append(f"ip netns del {ns}: {proc.stderr.strip()}")
            self._created.clear()
        _open_stars.discard(self)
        if errors:
            raise NetnsCommandError(["ip", "netns", "del"], 1, "; ".join(errors))

    def __enter__(self) -> Star:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"Star(prefix={self.prefix!r}, clients={self.num_clients}, rate_bps={self.rate_bps}, {state})"


def shape(dev: str, rate: str | int, burst_bytes: int | None = None, latency_ms: int = 50) -> list[str]:
    """Apply tbf to the existing device ``dev`` in the current namespace; return the command run."""
    if shutil.which("tc") is None:
        raise LinkShapingUnavailable("link shaping unavailable: 'tc' not found on PATH (install iproute2)")
    cmd = tbf_command(dev, _coerce_rate(rate), burst_bytes, latency_ms)
    try:
        _run(cmd)
    except NetnsCommandError as exc:
        if "not permitted" in exc.stderr.lower() or "permission denied" in exc.stderr.lower():
            raise LinkShapingUnavailable(
                f"link shaping unavailable: not permitted to change qdiscs on {dev} "
                f"(run as root or grant CAP_NET_ADMIN, e.g. docker --cap-add NET_ADMIN): {exc}"
            ) from None
        raise
    return cmd


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m wafl.cli.launch.netns shape --dev DEV --rate RATE``."""
    parser = argparse.ArgumentParser(prog="python -m wafl.cli.launch.netns", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_shape = sub.add_parser("shape", help="limit an existing interface's egress with tc tbf")
    p_shape.add_argument("--dev", required=True, help="interface name, e.g. eth0")
    p_shape.add_argument("--rate", required=True, help="tc-style rate, e.g. 20mbit")
    p_shape.add_argument("--burst", type=int, default=None, help="bucket size in bytes")
    p_shape.add_argument("--latency-ms", type=int, default=50, help="max queueing delay (default 50)")
    p_shape.add_argument("--dry-run", action="store_true", help="print the command without running it")
    args = parser.parse_args(argv)

    try:
        rate_bps = parse_rate(args.rate)
        cmd = tbf_command(args.dev, rate_bps, args.burst, args.latency_ms)
    except ValueError as exc:
        parser.error(str(exc))
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    try:
        shape(args.dev, rate_bps, args.burst, args.latency_ms)
    except LinkShapingUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return LinkShapingUnavailable.exit_code
    except NetnsCommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Entrypoint of the wafl container image: prepares the container, then runs the wafl CLI.

Usage:  wafl-entrypoint [wafl] COMMAND [ARGS...]      e.g. ``server --clients 4``, ``client``
        wafl-entrypoint --dry-run COMMAND [ARGS...]   print what would be done, as JSON; change nothing
        wafl-entrypoint --print-index                 print the client index this container derives
        wafl-entrypoint --health                      the container health check (gRPC health service)

The arguments are the wafl CLI's, unchanged; the process finally exec'd is
``python -m wafl.cli.main ARGS`` (what the ``wafl`` script and ``wafl run`` start). Before that:

1. ``client`` without ``--index`` and without ``WAFL_CLIENT_INDEX``: the index comes from
   ``WAFL_CLIENT_INDEX_FROM``:

   * ``claim`` (what docker-compose.yml sets; its containers share the host's network): the
     lowest free index from ``WAFL_CLIENT_INDEX_OFFSET`` on, claimed by binding the abstract
     Unix socket ``@wafl-client-index/<server>/<index>`` in the network namespace the clients
     share. The client process holds the socket for its lifetime (it is inherited across exec),
     so the kernel releases the index when the client exits, however it exits, and a restarted
     client takes a free one again; two clients can never hold the same index.
   * ``name`` (the default; containers on a user-defined network): the container's replica
     number, the trailing number of its name (``wafl-client-3`` or ``wafl_client_3`` -> replica 3
     -> index 2, plus ``WAFL_CLIENT_INDEX_OFFSET``). The name is taken from ``WAFL_CLIENT_NAME``,
     else from the hostname, else from a reverse DNS (PTR) query for the container's own address
     sent to the resolver in /etc/resolv.conf (Docker's embedded DNS answers
     ``<container name>.<network>``; /etc/hosts, which only knows the hostname, is not consulted).

   The index goes to the CLI as ``WAFL_CLIENT_INDEX``. No index: exit 2. A client without
   ``--server`` and ``WAFL_SERVER`` dials ``127.0.0.1:$WAFL_PORT`` (default 50051).
2. ``WAFL_LINK_RATE`` (e.g. ``20mbit``): ``server`` and ``client`` limit the egress of
   ``WAFL_LINK_DEV`` (default eth0) with ``python -m wafl.cli.netns shape`` (tc tbf). That needs
   a network namespace of the container's own (not ``WAFL_HOST_NETWORK=1``, which says the
   container shares the host's: its eth0 is the host's interface) and CAP_NET_ADMIN, i.e. a
   container started as root with ``cap_add: [NET_ADMIN]``; without either the entrypoint exits
   77 with a message, or, when ``WAFL_LINK_OPTIONAL=1``, warns and goes on unshaped. ``bench`` and
   ``run`` get ``--link-rate`` instead (network namespaces of their own; root). ``WAFL_SERVER_LINK_RATE``,
   when set, is the server's rate instead (the server's link carries every client's traffic: ``wafl
   run --link-rate`` gives it the clients' sum).
3. ``WAFL_ARGS``: extra arguments appended to the command (split like a shell would).
4. Started as root: drops to the user ``WAFL_RUN_AS`` (default ``wafl``) unless that is empty or
   ``root``, or the command needs root (``bench``/``run`` with a link rate).
5. Writes ``WAFL_ROLE_FILE`` (default /tmp/wafl-role.json): the command and the address the
   health check probes. ``--health`` runs ``wafl health`` against it: a server probes itself,
   a client its server; other commands have nothing to probe and are healthy.

Only the standard library is used, so the script can be tested outside a container.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import random
import re
import shlex
import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

PROG = "wafl-entrypoint"
NET_ADMIN_BIT = 12  # CAP_NET_ADMIN, linux/capability.h
EXIT_NO_INDEX = 2
EXIT_LINK_UNAVAILABLE = 77  # as `python -m wafl.cli.netns shape`
DEFAULT_PORT = 50051
ROLE_FILE = "/tmp/wafl-role.json"
_TRUE = ("1", "true", "yes", "on")
_REPLICA_RE = re.compile(r"[-_](\d+)$")
CLAIM_LIMIT = 4096  # indices tried from the offset on
INDEX_SOURCES = ("name", "claim")
_held_claims: list[socket.socket] = []  # claimed indices stay bound until this process (after exec: the CLI) exits


class EntrypointError(Exception):
    """A condition the entrypoint reports with a message and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------- arguments


def split_command(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Returns (wafl subcommand, wafl arguments); a leading ``wafl`` is dropped."""
    args = list(argv)
    if args and args[0] == "wafl":
        args = args[1:]
    command = next((a for a in args if not a.startswith("-")), None)
    return command, args


def option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args`` (the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


# ---------------------------------------------------------------------------- client index


def replica_number(name: str) -> int | None:
    """The replica number a container name ends with: ``proj-client-3``, ``proj_client_3.net`` -> 3."""
    label = name.strip().rstrip(".").split(".", 1)[0]
    m = _REPLICA_RE.search(label)
    return int(m.group(1)) if m else None


def own_addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses (a container's come from /etc/hosts)."""
    found: list[str] = []
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        ip = str(info[4][0])
        if not ip.startswith("127.") and ip not in found:
            found.append(ip)
    return found


def nameservers(env: Mapping[str, str], resolv_conf: str = "/etc/resolv.conf") -> list[tuple[str, int]]:
    """``WAFL_DNS_SERVER`` (HOST[:PORT]) if set, else the nameservers of resolv.conf (IPv4)."""
    override = env.get("WAFL_DNS_SERVER", "").strip()
    if override:
        host, _, port = override.partition(":")
        return [(host, int(port or 53))]
    servers: list[tuple[str, int]] = []
    try:
        with open(resolv_conf) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver" and ":" not in parts[1]:
                    servers.append((parts[1], 53))
    except OSError:
        pass
    return servers[:3]


def _encode_name(name: str) -> bytes:
    return b"".join(bytes([len(label)]) + label.encode() for label in name.split(".") if label) + b"\0"


def _decode_name(msg: bytes, offset: int) -> tuple[str, int]:
    """Reads a (possibly compressed) domain name; returns it and the offset after it."""
    labels: list[str] = []
    end = None
    for _ in range(128):  # bounded: a pointer loop is not followed forever
        length = msg[offset]
        if length & 0xC0 == 0xC0:
            if end is None:
                end = offset + 2
            offset = ((length & 0x3F) << 8) | msg[offset + 1]
            continue
        offset += 1
        if length == 0:
            return ".".join(labels), end if end is not None else offset
        labels.append(msg[offset : offset + length].decode("ascii", "replace"))
        offset += length
    raise ValueError("malformed DNS name")


def ptr_query(ip: str, server: tuple[str, int], timeout: float = 1.0) -> list[str]:
    """Names a DNS server returns for ``ip`` (a PTR query over UDP); [] when it has none."""
    qname = ".".join(reversed(ip.split("."))) + ".in-addr.arpa"
    qid = random.randrange(1 << 16)
    query = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0) + _encode_name(qname) + struct.pack(">HH", 12, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(query, server)
        while True:
            msg, _ = s.recvfrom(4096)
            if len(msg) >= 12 and struct.unpack(">H", msg[:2])[0] == qid:
                break
    _, flags, qdcount, ancount, _, _ = struct.unpack(">HHHHHH", msg[:12])
    if flags & 0x000F:  # rcode: NXDOMAIN, SERVFAIL, ...
        return []
    offset = 12
    for _ in range(qdcount):
        _, offset = _decode_name(msg, offset)
        offset += 4
    names: list[str] = []
    for _ in range(ancount):
        _, offset = _decode_name(msg, offset)
        rtype, _, _, rdlength = struct.unpack(">HHIH", msg[offset : offset + 10])
        offset += 10
        if rtype == 12:
            names.append(_decode_name(msg, offset)[0])
        offset += rdlength
    return names


def candidate_names(env: Mapping[str, str]) -> Iterator[tuple[str, str | None]]:
    """(source, name) pairs to take a replica number from, cheapest first, computed lazily.

    A None name stands for a source that gave no name (it is named in the failure message).
    """
    if env.get("WAFL_CLIENT_NAME"):
        yield "WAFL_CLIENT_NAME", env["WAFL_CLIENT_NAME"]
    yield "hostname", socket.gethostname()
    addresses, servers = own_addresses(), nameservers(env)
    answered = False
    for ip in addresses:
        for server in servers:
            try:
                names = ptr_query(ip, server)
            except (OSError, ValueError, IndexError, struct.error):
                continue
            for name in names:
                answered = True
                yield f"reverse DNS of {ip}", name
    if not answered:
        where = ", ".join(f"{h}:{p}" for h, p in servers) or "no nameserver"
        yield f"reverse DNS of {', '.join(addresses) or 'no own address'} via {where}", None


def server_address(args: Sequence[str], env: Mapping[str, str]) -> str:
    """The server a client dials: ``--server``, else ``WAFL_SERVER``, else 127.0.0.1 at ``WAFL_PORT``."""
    return (
        option(args, "--server")
        or env.get("WAFL_SERVER", "").strip()
        or f"127.0.0.1:{env.get('WAFL_PORT') or DEFAULT_PORT}"
    )


def claim_name(server: str, index: int) -> bytes:
    """The abstract socket name (leading NUL) that stands for ``index`` among the clients of ``server``."""
    key = server if len(server) <= 64 else hashlib.sha256(server.encode()).hexdigest()[:32]
    return f"\0wafl-client-index/{key}/{index}".encode()


def claim_index(server: str, offset: int, limit: int = CLAIM_LIMIT) -> tuple[int, socket.socket]:
    """Binds the first free claim socket from ``offset`` on; returns the index and the bound socket.

    The socket is inheritable: kept open across exec, it is released by the kernel when the
    process that holds it exits. Clients in one network namespace (containers on the host's
    network, processes on one machine) see each other's claims; others do not.
    """
    for index in range(offset, offset + limit):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(claim_name(server, index))
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                continue
            raise EntrypointError(f"cannot claim a client index (abstract Unix socket): {e}", EXIT_NO_INDEX) from None
        sock.set_inheritable(True)
        return index, sock
    raise EntrypointError(
        f"no free client index among {offset}..{offset + limit - 1} for server {server}", EXIT_NO_INDEX
    )


def derive_index(
    env: Mapping[str, str],
    names: Callable[[Mapping[str, str]], Iterator[tuple[str, str | None]]] = candidate_names,
    server: str | None = None,
) -> tuple[int, str]:
    """The client index and where it came from; raises :class:`EntrypointError` when there is none.

    A claimed index (``WAFL_CLIENT_INDEX_FROM=claim``) stays claimed while this process lives.
    """
    explicit = env.get("WAFL_CLIENT_INDEX", "").strip()
    if explicit:
        if not explicit.isdigit():
            raise EntrypointError(f"WAFL_CLIENT_INDEX={explicit!r} is not a non-negative integer", EXIT_NO_INDEX)
        return int(explicit), "WAFL_CLIENT_INDEX"
    offset_text = env.get("WAFL_CLIENT_INDEX_OFFSET", "").strip() or "0"
    if not offset_text.isdigit():
        raise EntrypointError(f"WAFL_CLIENT_INDEX_OFFSET={offset_text!r} is not a non-negative integer", EXIT_NO_INDEX)
    source = env.get("WAFL_CLIENT_INDEX_FROM", "").strip().lower() or "name"
    if source not in INDEX_SOURCES:
        raise EntrypointError(f"WAFL_CLIENT_INDEX_FROM={source!r} is neither 'name' nor 'claim'", EXIT_NO_INDEX)
    if source == "claim":
        server = server or server_address((), env)
        index, sock = claim_index(server, int(offset_text))
        _held_claims.append(sock)
        return index, f"a claim among the clients of {server} on this network"
    tried: list[str] = []
    for source, name in names(env):
        replica = None if name is None else replica_number(name)
        if replica is None:
            tried.append(f"{source}: no name" if name is None else f"{source} {name!r}")
            continue
        if replica < 1:
            raise EntrypointError(
                f"{source} {name!r} ends in replica number {replica}; replica numbers start at 1 "
                "(client-1 is index 0): set WAFL_CLIENT_INDEX instead",
                EXIT_NO_INDEX,
            )
        return int(offset_text) + replica - 1, f"{source} {name!r}"
    raise EntrypointError(
        "cannot derive the client index: set WAFL_CLIENT_INDEX, or run the client as a replica whose "
        "container name ends in its replica number (docker compose up --scale client=N names them "
        f"<project>-client-1, -2, ...); tried: {', '.join(tried) or 'nothing'}",
        EXIT_NO_INDEX,
    )


# ---------------------------------------------------------------------------- link shaping


def has_net_admin(status_text: str | None = None) -> bool:
    """Whether CAP_NET_ADMIN is in this process's effective set (/proc/self/status ``CapEff``)."""
    if status_text is None:
        try:
            with open("/proc/self/status") as f:
                status_text = f.read()
        except OSError:
            return False
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", status_text, re.MULTILINE)
    return bool(m) and bool(int(m.group(1), 16) >> NET_ADMIN_BIT & 1)


def shape_command(rate: str, dev: str, dry_run: bool = False) -> list[str]:
    """The command that puts the tbf qdisc on ``dev``: the CLI's own ``wafl.cli.netns shape``."""
    cmd = [sys.executable, "-m", "wafl.cli.netns", "shape", "--dev", dev, "--rate", rate]
    return [*cmd, "--dry-run"] if dry_run else cmd


# ---------------------------------------------------------------------------- health


def health_target(command: str | None, args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """HOST:PORT the health check probes: a server itself, a client its server; else None."""
    if command == "server":
        host = option(args, "--host") or env.get("WAFL_HOST") or "0.0.0.0"
        port = option(args, "--port") or env.get("WAFL_PORT") or str(DEFAULT_PORT)
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{port}"
    if command == "client":
        return server_address(args, env)
    return None


def health_argv(env: Mapping[str, str]) -> list[str] | None:
    """The ``wafl health`` command of the health check, or None when there is nothing to probe."""
    path = env.get("WAFL_ROLE_FILE") or ROLE_FILE
    try:
        with open(path) as f:
            role = json.load(f)
        target = role.get("health")
    except (OSError, ValueError):  # not written yet: the image's main use, a server
        target = f"127.0.0.1:{env.get('WAFL_PORT') or DEFAULT_PORT}"
    if not target:
        return None
    timeout = env.get("WAFL_HEALTH_TIMEOUT") or "3"
    return [sys.executable, "-m", "wafl.cli.main", "health", "--server", target, "--timeout", timeout]


# ---------------------------------------------------------------------------- plan and run


def plan(
    argv: Sequence[str],
    env: Mapping[str, str],
    names: Callable[[Mapping[str, str]], Iterator[tuple[str, str | None]]] = candidate_names,
) -> dict:
    """Everything the entrypoint will do for ``argv``, computed without side effects."""
    command, args = split_command(argv)
    args += shlex.split(env.get("WAFL_ARGS", ""))
    new_env: dict[str, str] = {}
    notes: list[str] = []
    index = None
    if command == "client" and option(args, "--server") is None and not env.get("WAFL_SERVER", "").strip():
        new_env["WAFL_SERVER"] = server_address(args, env)
    if command == "client" and option(args, "--index") is None:
        index, source = derive_index(env, names, server_address(args, {**env, **new_env}))
        new_env["WAFL_CLIENT_INDEX"] = str(index)
        notes.append(f"client index {index} from {source}")
    rate = env.get("WAFL_LINK_RATE", "").strip()
    if command == "server" and env.get("WAFL_SERVER_LINK_RATE", "").strip():
        rate = env["WAFL_SERVER_LINK_RATE"].strip()  # e.g. the clients' sum, as `wafl run --link-rate` gives it
    dev = env.get("WAFL_LINK_DEV", "").strip() or "eth0"
    shape = None
    needs_root = False
    if rate and command in ("server", "client"):
        shape = {"rate": rate, "dev": dev, "cmd": shape_command(rate, dev)}
    elif rate and command in ("bench", "run"):
        if option(args, "--link-rate") is None:
            args += ["--link-rate", rate]
        needs_root = True
        notes.append(
            f"{command}: links shaped to {rate} in network namespaces (needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN)"
        )
    elif rate:
        notes.append(f"WAFL_LINK_RATE ignored for {command!r}")
    run_as = env.get("WAFL_RUN_AS", "wafl").strip()
    if needs_root or run_as in ("", "root", "0"):
        run_as = ""
    return {
        "command": command,
        "argv": [sys.executable, "-m", "wafl.cli.main", *args],
        "env": new_env,
        "index": index,
        "shape": shape,
        "link_optional": env.get("WAFL_LINK_OPTIONAL", "").strip().lower() in _TRUE,
        "host_network": env.get("WAFL_HOST_NETWORK", "").strip().lower() in _TRUE,
        "run_as": run_as,
        "health": health_target(command, args, {**env, **new_env}),
        "notes": notes,
    }


def apply_shaping(p: dict, net_admin: bool, run: Callable[[list[str]], int]) -> None:
    """Runs the shaping command of plan ``p``; raises :class:`EntrypointError` (77) when it cannot."""
    if not p["shape"]:
        return
    rate, dev, cmd = p["shape"]["rate"], p["shape"]["dev"], p["shape"]["cmd"]
    problem = None
    if p.get("host_network"):
        problem = (
            f"WAFL_LINK_RATE={rate}: this container shares the host's network (WAFL_HOST_NETWORK=1, "
            f"network_mode: host), so {dev} here is the host's own interface and is left alone; shaped links "
            "run in network namespaces of their own: the bench service with docker/compose.shaped.yml, or "
            "`wafl run --link-rate` through the bench service of that override"
        )
    elif not net_admin:
        problem = (
            f"WAFL_LINK_RATE={rate} needs CAP_NET_ADMIN to shape {dev}, and this container has not got it: "
            "start it as root with `cap_add: [NET_ADMIN]` (docker/compose.shaped.yml; docker run --user 0 "
            "--cap-add NET_ADMIN); the entrypoint drops to the wafl user after shaping"
        )
    else:
        code = run(cmd)
        if code == EXIT_LINK_UNAVAILABLE:
            problem = f"link shaping of {dev} to {rate} is not available here (see the message above)"
        elif code != 0:
            raise EntrypointError(f"link shaping of {dev} to {rate} failed (exit {code}): {shlex.join(cmd)}", code)
    if problem is None:
        return
    if p["link_optional"]:
        print(
            f"{PROG}: warning: {problem}; WAFL_LINK_OPTIONAL is set, continuing with an unshaped link",
            file=sys.stderr,
            flush=True,
        )
        return
    raise EntrypointError(f"{problem} (set WAFL_LINK_OPTIONAL=1 to run unshaped instead)", EXIT_LINK_UNAVAILABLE)


def drop_privileges(user: str, env: dict[str, str]) -> str | None:
    """As root, becomes ``user``; returns a note when it stays as it is."""
    if not user or os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return f"user {user!r} does not exist here; staying uid 0"
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    return None


def write_role(p: dict, env: Mapping[str, str]) -> None:
    path = env.get("WAFL_ROLE_FILE") or ROLE_FILE
    try:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"command": p["command"], "health": p["health"]}, f)
        os.replace(tmp, path)
    except OSError as e:
        print(f"{PROG}: warning: cannot write {path} for the health check: {e}", file=sys.stderr)


def _run(cmd: list[str]) -> int:
    return subprocess.run(cmd).returncode


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    execve: Callable[[str, list[str], dict[str, str]], object] = os.execve,
    run: Callable[[list[str]], int] = _run,
    net_admin: Callable[[], bool] = has_net_admin,
) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if environ is None else environ)
    try:
        if argv[:1] == ["--health"]:
            cmd = health_argv(env)
            if cmd is None:
                print(f"{PROG}: nothing to probe for this container's command")
                return 0
            try:
                execve(cmd[0], cmd, env)
            except OSError as e:
                raise EntrypointError(f"cannot start {shlex.join(cmd)}: {e}", 127) from None
            return 0
        if argv[:1] == ["--print-index"]:
            index, source = derive_index(env)  # a claim is released when this process exits
            print(index)
            print(f"{PROG}: client index {index} from {source}", file=sys.stderr)
            return 0
        dry_run = argv[:1] == ["--dry-run"]
        if dry_run:
            argv = argv[1:]
        p = plan(argv, env)
        if dry_run:
            out = dict(p, net_admin=net_admin(), euid=os.geteuid())
            if p["shape"]:  # the tc command the CLI builds, printed by the CLI itself
                shown = subprocess.run(
                    shape_command(p["shape"]["rate"], p["shape"]["dev"], dry_run=True), capture_output=True, text=True
                )
                if shown.returncode != 0:
                    raise EntrypointError(
                        f"WAFL_LINK_RATE={p['shape']['rate']!r} rejected: {shown.stderr.strip()}", shown.returncode
                    )
                out["shape"] = dict(p["shape"], tc=shown.stdout.strip())
            print(json.dumps(out, indent=2))
            return 0
        for note in p["notes"]:
            print(f"{PROG}: {note}", file=sys.stderr)
        apply_shaping(p, net_admin(), run)
        env.update(p["env"])
        note = drop_privileges(p["run_as"], env)
        if note:
            print(f"{PROG}: {note}", file=sys.stderr)
        write_role(p, env)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            execve(p["argv"][0], p["argv"], env)
        except OSError as e:
            raise EntrypointError(f"cannot start {shlex.join(p['argv'])}: {e}", 127) from None
        return 0
    except EntrypointError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())

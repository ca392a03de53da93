"""The client index: ``WAFL_CLIENT_INDEX``, else a claim (``WAFL_CLIENT_INDEX_FROM=claim``), else the replica
number a container's name ends with (from ``WAFL_CLIENT_NAME``, the hostname or reverse DNS)."""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Callable, Iterator, Mapping

from . import claims, dns
from .args import server_address
from .errors import EXIT_NO_INDEX, EntrypointError

REPLICA_RE = re.compile(r"[-_](\d+)$")
INDEX_SOURCES = ("name", "claim")


def replica_number(name: str) -> int | None:
    """The replica number a container name ends with: ``proj-client-3``, ``proj_client_3.net`` -> 3."""
    label = name.strip().rstrip(".").split(".", 1)[0]
    m = REPLICA_RE.search(label)
    return int(m.group(1)) if m else None


def candidate_names(env: Mapping[str, str]) -> Iterator[tuple[str, str | None]]:
    """(source, name) pairs to take a replica number from, cheapest first, computed lazily.

    A None name stands for a source that gave no name (it is named in the failure message).
    """
    if env.get("WAFL_CLIENT_NAME"):
        yield "WAFL_CLIENT_NAME", env["WAFL_CLIENT_NAME"]
    yield "hostname", socket.gethostname()
    addresses, servers = dns.own_addresses(), dns.nameservers(env)
    answered = False
    for ip in addresses:
        for server in servers:
            try:
                names = dns.ptr_query(ip, server)
            except (OSError, ValueError, IndexError, struct.error):
                continue
            for name in names:
                answered = True
                yield f"reverse DNS of {ip}", name
    if not answered:
        where = ", ".join(f"{h}:{p}" for h, p in servers) or "no nameserver"
        yield f"reverse DNS of {', '.join(addresses) or 'no own address'} via {where}", None


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
        index, sock = claims.claim_index(server, int(offset_text))
        claims.held.append(sock)
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

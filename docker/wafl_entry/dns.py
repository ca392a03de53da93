"""This container's own addresses and a reverse DNS (PTR) query for one of them, sent over UDP to the resolver
of /etc/resolv.conf (Docker's embedded DNS answers ``<container name>.<network>``): a DNS client of its own,
so that the entrypoint needs only the standard library."""

from __future__ import annotations

import random
import socket
import struct
from collections.abc import Mapping


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

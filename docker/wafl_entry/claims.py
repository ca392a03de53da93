"""A client index claimed by binding the abstract Unix socket ``@wafl-client-index/<server>/<index>`` in the
network namespace the clients share: the kernel releases it when the process holding it exits."""

from __future__ import annotations

import errno
import hashlib
import socket

from .errors import EXIT_NO_INDEX, EntrypointError

CLAIM_LIMIT = 4096  # indices tried from the offset on
held: list[socket.socket] = []  # claimed indices stay bound until this process (after exec: the CLI) exits


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

"""The harness of the wire tests: a real ``wafl server`` process on a free localhost port, clients built
from the .proto alone (``independent_client``) joined to it, and all of it stopped afterwards.

A test module subclasses :class:`JoinedFederation` with its own round bookkeeping and serves it from a
module fixture through :func:`serving`; the generated stubs come from the ``stubs`` fixture of
``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from independent_client import IndependentClient, ServerProcess, join_clients


class JoinedFederation:
    """A server process and one joined, listening client per entry of ``num_samples`` (ids ``prefix-<i>-...``)."""

    def __init__(
        self, pb: Any, pb_grpc: Any, server: ServerProcess, prefix: str, num_samples: Sequence[int], token: str = ""
    ) -> None:
        self.pb, self.pb_grpc, self.server = pb, pb_grpc, server
        self.clients = join_clients(pb, pb_grpc, server, prefix, num_samples, token)
        self.manifest = list(self.clients[0].reply.manifest)

    @property
    def a(self) -> IndependentClient:
        return self.clients[0]

    @property
    def b(self) -> IndependentClient:
        return self.clients[1]

    def close(self) -> None:
        for c in self.clients:
            c.close()


F = TypeVar("F", bound=JoinedFederation)


@contextlib.contextmanager
def serving(
    make: Callable[[ServerProcess], F],
    config: dict[str, Any],
    work: Path,
    extra_args: Sequence[str] = (),
    first_round: bool = True,
    must_survive: bool = True,
) -> Iterator[F]:
    """Starts a server of ``config`` in ``work``, yields ``make(server)`` (once round 1's model has reached
    the first client, with ``first_round``), then closes the clients and stops the server; with
    ``must_survive`` the server must still have been running at the end."""
    server = ServerProcess(config, work, extra_args=extra_args)
    federation = None
    try:
        federation = make(server)
        if first_round:
            federation.a.listener.wait(1)
        yield federation
    finally:
        if federation is not None:
            federation.close()
        alive = server.alive()
        server.stop()
    if must_survive:
        assert alive, "the server process died during the tests"

"""Admission per peer: no caller without a credential can crowd out the federation, no client another.

Every call passes :class:`Admission`, a gRPC server interceptor, before its handler runs and
before its first message is read:

- ``Upload``, ``Broadcasts`` and ``Report`` must carry a session credential of a registered
  client (metadata ``wafl-credential``) before they count anywhere: without one the call is
  refused at once (``UNAUTHENTICATED``), whatever the caller sends or withholds afterwards, so a
  silent stream of an outsider costs the server nothing. With one, the call counts against that
  client's own budget (:class:`ClientCalls`): at most ``calls`` calls at once (more:
  ``RESOURCE_EXHAUSTED``), and one ``Broadcasts`` stream: once the service has authorized a new
  one (:meth:`ClientCalls.stream`), it replaces (``CANCELLED``) the older, so an idle or
  forgotten stream never accumulates.
- Everything else (``Join``, the health and reflection services) waits in the :class:`Lobby`, a
  small shared budget of its own (32 calls plus one per client): a unary call must deliver its
  request within ``read_s`` (``DEADLINE_EXCEEDED``), and when the lobby is full the call that has
  waited longest is cut off (``UNAVAILABLE``, which clients retry) to make room. An honest Join
  or health check delivers its request with its headers and leaves the lobby at once; callers
  that hold calls open and silent only push each other out.

``Join`` refused for a bad token or enrollment secret (``UNAUTHENTICATED``) is counted per peer
address (its host, the port apart) by :class:`FailedJoins`: ``burst`` such failures at once and
``per_s`` more each second; beyond that, every Join from that address is refused at once with
``RESOURCE_EXHAUSTED`` (before its secret is checked, so guessing runs no faster) until the budget
refills, and the failures are logged: one ``auth.failed`` line at most every ``log_every_s``,
with their count since the last line, in all, and the addresses refused meanwhile.

Handlers whose request is a single message are served as streaming-request handlers (the wire
format is the same), so that the wait for that message happens here, bounded, instead of inside
gRPC with no limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from wafl.common.errors import Code, InvariantError, Refused

CREDENTIALED = ("/wafl.v1.Federation/Upload", "/wafl.v1.Federation/Report", "/wafl.v1.Federation/Broadcasts")
BROADCASTS = "/wafl.v1.Federation/Broadcasts"
LOBBY_SIZE = 32  # calls without a credential waiting at once (Join, health, reflection), plus one per client
LOBBY_READ_S = 10.0  # a unary call in the lobby must deliver its request within this
CLIENT_CALLS = 4  # uploads and reports of one client at once (its Broadcasts stream apart)
FAILED_JOIN_BURST = 20.0  # Joins with a bad secret one address may make at once ...
FAILED_JOIN_PER_S = 1.0  # ... and each second after
FAILED_JOIN_LOG_S = 10.0  # at most one auth.failed line this often
FAILED_JOIN_PEERS = 10_000  # addresses remembered at once (those whose budget is full are forgotten first)
log = structlog.get_logger("server")


def _current_task(what: str) -> asyncio.Task[Any]:
    """The task running ``what`` (which cancels, and is cancelled, as a task); raises :class:`InvariantError` outside
    one."""
    task = asyncio.current_task()
    if task is None:
        raise InvariantError(f"{what} must run inside an asyncio task")
    return task


class Lobby:
    """At most ``size`` calls at once; a newcomer to a full lobby cuts off the one that has waited longest."""

    def __init__(self, size: int = LOBBY_SIZE, read_s: float = LOBBY_READ_S) -> None:
        self.size = size
        self.read_s = read_s
        self.calls: OrderedDict[int, asyncio.Task[Any]] = OrderedDict()
        self.cut: set[int] = set()
        self.ids = itertools.count()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        task = _current_task("Lobby.admit")
        key = next(self.ids)
        while len(self.calls) >= self.size:
            old, old_task = self.calls.popitem(last=False)
            self.cut.add(old)
            old_task.cancel()
        self.calls[key] = task
        try:
            yield
        except asyncio.CancelledError:
            if key not in self.cut:
                raise
            task.uncancel()
            raise Refused("too many calls without a credential are waiting; retry shortly", Code.UNAVAILABLE) from None
        finally:
            self.calls.pop(key, None)
            self.cut.discard(key)


class ClientCalls:
    """Each client's own budget: ``calls`` uploads and reports at once, and one Broadcasts stream."""

    def __init__(self, calls: int = CLIENT_CALLS) -> None:
        self.calls = calls
        self.open: dict[int, int] = {}
        self.streams: dict[int, asyncio.Task[Any]] = {}
        self.replaced: set[int] = set()  # ids of the tasks whose stream a newer one replaced

    @contextlib.asynccontextmanager
    async def call(self, index: int) -> AsyncIterator[None]:
        n = self.open.get(index, 0)
        if n >= self.calls:
            raise Refused(
                f"client_index {index} already has {self.calls} calls in progress; wait for them",
                Code.RESOURCE_EXHAUSTED,
            )
        self.open[index] = n + 1
        try:
            yield
        finally:
            left = self.open[index] - 1
            if left:
                self.open[index] = left
            else:
                del self.open[index]

    @contextlib.asynccontextmanager
    async def stream(self, index: int) -> AsyncIterator[None]:
        task = _current_task("ClientCalls.stream")
        old = self.streams.get(index)
        if old is not None and not old.done():
            self.replaced.add(id(old))
            old.cancel()
        self.streams[index] = task
        try:
            yield
        except asyncio.CancelledError:
            if id(task) not in self.replaced:
                raise
            task.uncancel()
            raise Refused("replaced by a newer Broadcasts stream of this client", Code.CANCELLED) from None
        finally:
            self.replaced.discard(id(task))
            if self.streams.get(index) is task:
                del self.streams[index]


def peer_host(peer: str) -> str:
    """The address of a gRPC peer (``ipv4:10.0.0.3:51234``) without its port: ``ipv4:10.0.0.3``."""
    head, sep, port = peer.rpartition(":")
    return head if sep and port.isdigit() and head not in ("ipv4", "ipv6") else peer


class FailedJoins:
    """Joins refused for a bad secret, per peer address: a token bucket of ``burst`` failures refilled at
    ``per_s`` a second, and their log lines (see the module docstring)."""

    def __init__(
        self,
        burst: float = FAILED_JOIN_BURST,
        per_s: float = FAILED_JOIN_PER_S,
        log_every_s: float = FAILED_JOIN_LOG_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.per_s, self.log_every_s, self.clock = burst, per_s, log_every_s, clock
        self.buckets: dict[str, tuple[float, float]] = {}  # address -> (failures left, when)
        self.total = 0  # failed Joins in all
        self.throttled = 0  # Joins refused at once, in all
        self.pending = 0  # failures since the last log line
        self.pending_throttled = 0
        self.pending_peers: set[str] = set()
        self.last_log = -math.inf

    def _left(self, peer: str, now: float) -> float:
        left, then = self.buckets.get(peer, (self.burst, now))
        return min(self.burst, left + (now - then) * self.per_s)

    def check(self, peer: str) -> None:
        """Raises :class:`Refused` (RESOURCE_EXHAUSTED) while ``peer`` has no failures left."""
        now = self.clock()
        left = self._left(peer, now)
        if left >= 1.0:
            return
        self.throttled += 1
        self.pending_throttled += 1
        self._note(peer, now)
        wait = (1.0 - left) / self.per_s
        raise Refused(
            f"too many joins with a bad token or secret from this address; retry in {math.ceil(wait)} s",
            Code.RESOURCE_EXHAUSTED,
        )

    def failed(self, peer: str) -> None:
        """Counts one Join from ``peer`` refused for its secret."""
        now = self.clock()
        if len(self.buckets) >= FAILED_JOIN_PEERS:
            self.buckets = {p: (n, t) for p, (n, t) in self.buckets.items() if self._left(p, now) < self.burst}
        self.buckets[peer] = (self._left(peer, now) - 1.0, now)
        self.total += 1
        self.pending += 1
        self._note(peer, now)

    def _note(self, peer: str, now: float) -> None:
        if len(self.pending_peers) < 100:
            self.pending_peers.add(peer)
        if now - self.last_log < self.log_every_s:
            return
        log.warning(
            "auth.failed",
            failed=self.pending,
            refused_at_once=self.pending_throttled,
            failed_total=self.total,
            addresses=sorted(self.pending_peers)[:10],
            since_s=None if math.isinf(self.last_log) else round(now - self.last_log, 1),
        )
        self.last_log = now
        self.pending = self.pending_throttled = 0
        self.pending_peers = set()


async def _abort(ctx: grpc.aio.ServicerContext, e: Refused) -> None:
    await ctx.abort(getattr(grpc.StatusCode, e.code.value), str(e)[:300])


def _credential(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "wafl-credential":
            return value if isinstance(value, str) else ""
    return ""


async def _first(requests: AsyncIterator[Any], read_s: float) -> Any:
    try:
        async with asyncio.timeout(read_s):
            return await requests.__anext__()
    except TimeoutError:
        raise Refused(f"no request within {read_s:g} s", Code.DEADLINE_EXCEEDED) from None
    except StopAsyncIteration:
        raise Refused("the call ended before its request") from None


Guard = Callable[[], contextlib.AbstractAsyncContextManager[None]]


def _guarded(handler: grpc.RpcMethodHandler, guard: Guard, read_s: float, lobby_read: bool) -> grpc.RpcMethodHandler:
    """``handler`` served with a streaming request, its behavior run under ``guard``; a single
    request is read (within ``read_s``) under the guard too. ``lobby_read``: only that read is
    guarded (the call leaves the guard before its work), otherwise the whole call."""
    serde = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    unary_in = not handler.request_streaming
    behavior = (
        handler.unary_unary or handler.unary_stream if unary_in else handler.stream_unary or handler.stream_stream
    )

    async def _enter(requests: Any, ctx: grpc.aio.ServicerContext, stack: contextlib.AsyncExitStack) -> Any:
        await stack.enter_async_context(guard())
        if not unary_in:
            return requests
        request = await _first(requests, read_s)
        if lobby_read:
            await stack.aclose()
        return request

    if not handler.response_streaming:

        async def unary_out(requests: Any, ctx: grpc.aio.ServicerContext) -> Any:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    return await behavior(await _enter(requests, ctx, stack), ctx)
            except Refused as e:
                await _abort(ctx, e)

        return grpc.stream_unary_rpc_method_handler(unary_out, **serde)
    if inspect.isasyncgenfunction(behavior):

        async def stream_out(requests: Any, ctx: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    async for m in behavior(await _enter(requests, ctx, stack), ctx):
                        yield m
            except Refused as e:
                await _abort(ctx, e)

        return grpc.stream_stream_rpc_method_handler(stream_out, **serde)

    async def written_out(requests: Any, ctx: grpc.aio.ServicerContext) -> None:  # writes with ctx.write
        try:
            async with contextlib.AsyncExitStack() as stack:
                await behavior(await _enter(requests, ctx, stack), ctx)
        except Refused as e:
            await _abort(ctx, e)

    return grpc.stream_stream_rpc_method_handler(written_out, **serde)


def _refused(handler: grpc.RpcMethodHandler, e: Refused) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that refuses at once, reading nothing."""
    serde = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    async def refuse(requests: Any, ctx: grpc.aio.ServicerContext) -> None:
        await _abort(ctx, e)

    make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return make(refuse, **serde)


class Admission(grpc.aio.ServerInterceptor):
    """The interceptor of the module docstring. ``peer_of(credential)`` is the index of the
    registered client the credential belongs to, or raises :class:`Refused`."""

    def __init__(
        self,
        peer_of: Callable[[str], int],
        lobby: Lobby | None = None,
        clients: ClientCalls | None = None,
        read_s: float = LOBBY_READ_S,
    ) -> None:
        self.peer_of = peer_of
        self.lobby = lobby or Lobby()
        self.clients = clients or ClientCalls()
        self.read_s = read_s

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if details.method not in CREDENTIALED:
            return _guarded(handler, self.lobby.admit, self.lobby.read_s, lobby_read=not handler.response_streaming)
        try:
            index = self.peer_of(_credential(details.invocation_metadata))
        except Refused as e:
            return _refused(handler, e)
        # a Broadcasts call counts as a call until its request is read; the service then holds it
        # as the client's one stream (ClientCalls.stream) once the request is authorized
        return _guarded(handler, lambda: self.clients.call(index), self.read_s, lobby_read=details.method == BROADCASTS)

"""Where a client's training runs: its own threads, or a slot of a worker's shared pool.

:class:`~wafl.client.protocol.RoundProtocol` hands every piece of model work to a compute
object through two calls:

* ``run(fn, *args)``: work the federation waits for (loading a broadcast, GM training,
  knowledge, the upload's tensors, the compute-and-wait PM, evaluation);
* ``fill(train, stop, wake)``: the wait-free PM, which only fills time the client would
  otherwise idle. ``train(should_stop)`` trains until ``should_stop()``; ``stop`` is the
  client's own condition (the next broadcast), and the client sets ``wake`` whenever it may
  have turned true.

:class:`OwnThreads` is a client alone in its process (``wafl client``): ``run`` is a thread per
call, ``fill`` one thread at nice ``pm_nice``. :class:`SharedSlots` is shared by the many
clients of one worker process (``wafl worker``, :mod:`wafl.client.worker`): at most ``slots``
trainings run at once, and a free slot always goes to waiting federation work before any
fill work (first come, first served within each class). A wait-free PM that holds a slot while
federation work waits gives its slot up between two batches and continues when it gets one
back, unless its own broadcast arrived in the meantime; so a PM never delays another client's
GM, and keeps its meaning per client (it trains until its client's next broadcast).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, TypeVar

import structlog
from wafl.client.residency import Residency, Resident

T = TypeVar("T")
log = structlog.get_logger("client")

URGENT = 0  # work the federation waits for
FILL = 1  # work that only fills idle time (the wait-free PM)


class OwnThreads:
    """One client per process: a thread per call, and the wait-free PM in a thread at nice ``pm_nice``."""

    def __init__(self, pm_thread: bool, pm_nice: int = 0) -> None:
        self.background: ThreadPoolExecutor | None = None
        if pm_thread:
            self.background = ThreadPoolExecutor(
                1, thread_name_prefix="wafl-pm", initializer=lower_thread_priority, initargs=(pm_nice,)
            )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    async def fill(
        self, train: Callable[[Callable[[], bool]], T], stop: Callable[[], bool], wake: asyncio.Event | None = None
    ) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.background, train, stop)

    def close(self) -> None:
        if self.background is not None:
            self.background.shutdown(wait=False, cancel_futures=True)


class SharedSlots:
    """``slots`` trainings at once for all the clients of a worker; federation work before fill work.

    Slots are counted on the event loop that creates it (every call must come from that loop);
    the training itself runs in threads. :meth:`view` gives each client its compute object
    (the same pool); closing a view leaves the pool open.
    """

    def __init__(self, slots: int, residency: Residency | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1")
        self.slots = slots
        self.residency = residency  # on an accelerator: which clients keep their tensors on it
        self.free = slots
        self.waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # (class, order, granted)
        self.urgent_waiting = 0  # read from training threads: a fill holder gives its slot up
        self.order = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.executor = ThreadPoolExecutor(slots, thread_name_prefix="wafl-slot")
        # a fill holder that gave its slot up waits in its own thread: one thread per PM in progress
        self.fill_executor = ThreadPoolExecutor(4096, thread_name_prefix="wafl-fill")
        self.busy_max = 0  # the most slots ever held at once (a check that the bound holds)
        self.pauses: set[Future[bool]] = set()  # fill holders waiting in their thread for a slot

    # ------------------------------------------------------------ slot accounting (event loop)
    async def acquire(self, cls: int) -> None:
        self.loop = asyncio.get_running_loop()
        ahead = self.urgent_waiting if cls == URGENT else len(self.waiters)  # waiters of this class or a higher one
        if self.free > 0 and not ahead:
            self._take()
            return
        fut: asyncio.Future[None] = self.loop.create_future()
        heapq.heappush(self.waiters, (cls, next(self.order), fut))
        if cls == URGENT:
            self.urgent_waiting += 1
        try:
            await fut  # granted: the slot was handed over by release()
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted and cancelled at once: pass the slot on
            else:
                self.waiters = [w for w in self.waiters if w[2] is not fut]
                heapq.heapify(self.waiters)
                if cls == URGENT:
                    self.urgent_waiting -= 1
            raise

    def _take(self) -> None:
        self.free -= 1
        self.busy_max = max(self.busy_max, self.slots - self.free)

    def release(self) -> None:
        while self.waiters:
            cls, _, fut = heapq.heappop(self.waiters)
            if cls == URGENT:
                self.urgent_waiting -= 1
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the next waiter: free stays as it is
                return
        self.free += 1

    # ------------------------------------------------------------ the compute interface
    def view(self, client: Resident | None = None) -> SharedSlots | HostedSlots:
        """The compute object of one hosted client: the pool itself, or (with a residency) the pool with
        ``client``'s tensors brought to the device for each of its calls."""
        if self.residency is None or client is None:
            return self
        return HostedSlots(self, self.residency, client)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        await self.acquire(URGENT)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.release()

    async def fill(
        self, train: Callable[[Callable[[], bool]], T], stop: Callable[[], bool], wake: asyncio.Event | None = None
    ) -> T:
        await self.acquire(FILL)
        loop = asyncio.get_running_loop()
        held = [True]

        def should_stop() -> bool:
            if stop():
                return True
            if self.urgent_waiting > 0:  # give the slot to federation work, then continue (or end)
                pause = asyncio.run_coroutine_threadsafe(self._pause(stop, wake), loop)
                self.pauses.add(pause)
                try:
                    held[0] = pause.result()
                except CancelledError:  # the pool shut down (shutdown() cancels every pause)
                    held[0] = False
                finally:
                    self.pauses.discard(pause)
                return not held[0]
            return False

        try:
            return await loop.run_in_executor(self.fill_executor, train, should_stop)
        finally:
            if held[0]:
                self.release()

    async def _pause(self, stop: Callable[[], bool], wake: asyncio.Event | None) -> bool:
        """Gives the slot up and waits for another; False (and no slot) when ``stop()`` turns true first.

        ``wake`` is set by the client whenever ``stop()`` may have changed (without it: a check every 0.1 s)."""
        self.release()
        again = asyncio.ensure_future(self.acquire(FILL))
        while True:
            if wake is not None:
                wake.clear()
            if stop():
                again.cancel()
                try:
                    await again
                except asyncio.CancelledError:
                    return False
                return True  # granted before the cancel took effect: it holds the slot
            waits: set[asyncio.Future[Any]] = {again}
            woken = asyncio.ensure_future(wake.wait()) if wake is not None else None
            if woken is not None:
                waits.add(woken)
            await asyncio.wait(waits, timeout=None if woken is not None else 0.1, return_when=asyncio.FIRST_COMPLETED)
            if woken is not None:
                woken.cancel()
            if again.done():
                again.result()
                return True

    def close(self) -> None:
        pass  # the pool outlives each client; :meth:`shutdown` ends it

    def shutdown(self) -> None:
        for pause in list(self.pauses):
            pause.cancel()  # a paused PM's thread ends instead of waiting on a loop that is going away
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.fill_executor.shutdown(wait=False, cancel_futures=True)


class HostedSlots:
    """A hosted client's calls on the shared pool, each run with the client resident on the device."""

    def __init__(self, pool: SharedSlots, residency: Residency, client: Resident) -> None:
        self.pool, self.residency, self.client = pool, residency, client

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.pool.run(self.residency.bound(self.client, fn), *args)

    async def fill(
        self, train: Callable[[Callable[[], bool]], T], stop: Callable[[], bool], wake: asyncio.Event | None = None
    ) -> T:
        return await self.pool.fill(self.residency.bound(self.client, train), stop, wake)

    def close(self) -> None:
        pass


def lower_thread_priority(nice: int) -> None:
    """Sets the calling thread's nice value (Linux: per thread); a no-op for 0 or elsewhere."""
    if nice <= 0 or sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as e:  # e.g. a seccomp profile that forbids it: the PM runs at normal priority
        log.warning("pm.nice_failed", nice=nice, error=str(e))

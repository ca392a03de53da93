"""The client's round protocol: wait-free or compute-and-wait, one code path.

Per broadcast: evaluate the PM trained in the round that just closed (and report it), then,
if selected, train the GM for ``local_epochs`` and

* wait-free: start the upload in the background at once and train the PM batch after batch
  until the next broadcast has been received in full (checked between batches, so the PM stops
  within one batch of it; ``pm_min_steps``/``pm_max_epochs`` bound the loop). The PM keeps
  training while the broadcast streams in: stopping at its header would leave the client idle
  for the whole download;
* compute-and-wait: train the PM for ``pm_epochs``, then upload, then idle.

Every phase is recorded on the client's timeline; training runs in a worker thread so the
event loop keeps streaming. The wait-free PM trains in its own thread at nice ``pm_nice``
(Linux): it is there to fill time the client would otherwise idle, so where clients share
CPUs it must not slow down another client's GM, the server's aggregation or this client's
upload, which the round waits for. Nice values compare between processes of one session
(autogroup), which is how ``wafl run`` starts its processes.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from wafl.client.session import ReceivedModel, Session
from wafl.client.timeline import Timeline
from wafl.client.trainer import Trainer
from wafl.common.codec import crc32_of

log = structlog.get_logger("client")


class RoundProtocol:
    def __init__(self, session: Session, trainer: Trainer, protocol: str) -> None:
        if protocol not in ("wait-free", "compute-and-wait"):
            raise ValueError(f"protocol={protocol!r} is not one of ['wait-free', 'compute-and-wait']")
        self.session = session
        self.trainer = trainer
        self.protocol = protocol
        self.timeline = Timeline()
        self.pm_trained_round: int | None = None
        self.uploads: set[asyncio.Task[Any]] = set()
        self.reports: set[asyncio.Task[Any]] = set()  # PM reports, sent without holding up the next round
        self.bytes_up = 0
        self.arrived = 0  # complete broadcasts received; the wait-free PM loop watches this
        self.background: ThreadPoolExecutor | None = None
        if protocol == "wait-free" and trainer.algorithm.personalized:
            self.background = ThreadPoolExecutor(
                1, thread_name_prefix="wafl-pm", initializer=lower_thread_priority, initargs=(trainer.cfg.pm_nice,)
            )

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            if self.background is not None:
                self.background.shutdown(wait=False, cancel_futures=True)

    async def _run(self) -> None:
        models = self.session.models()
        idle_since: float | None = None
        async for model in _prefetch(models, self._on_arrival):
            if idle_since is not None:
                self.timeline.events.append(_event("idle", model.round - 1, idle_since, self.timeline.now()))
            await self._evaluate_pm(model)
            if model.final:
                await self._drain_uploads()
                final = {
                    "final": 1.0,
                    "bytes_up": float(self.bytes_up),
                    "global_crc32": float(crc32_of(model.state.values())),
                }
                await self.session.report(model.round - 1, final, self.timeline.events, self.timeline.start_unix)
                log.info("run.final", round=model.round - 1)
                return
            await self._round(model)
            idle_since = self.timeline.now()

    def _on_arrival(self) -> None:
        self.arrived += 1

    async def _round(self, model: ReceivedModel) -> None:
        t = self.trainer
        r = model.round
        seen = self.arrived
        await asyncio.to_thread(t.begin_round, r, model.state, model.knowledge, model.server_state)
        selected = self.session.client_id in model.selected
        if selected:
            with self.timeline.phase("gm_train", r):
                stats = await asyncio.to_thread(t.train_gm)
                knowledge = await asyncio.to_thread(t.knowledge)
                metrics = {"train_loss": stats.mean_loss, "train_steps": float(stats.steps)}
                if t.algorithm.knowledge is not None:
                    metrics["knowledge_received"] = float(len(model.knowledge))
                if t.algorithm.local_model_is_personal:
                    acc, n = await asyncio.to_thread(t.evaluate_local, t.gm)
                    metrics.update(pm_accuracy=acc, pm_test_samples=float(n))
                state = await asyncio.to_thread(t.gm_upload_state)
        if (
            t.algorithm.personalized
            and self.protocol == "compute-and-wait"
            and selected
            and self.trainer.cfg.pm_epochs > 0
        ):
            with self.timeline.phase("pm_train", r):
                await asyncio.to_thread(t.train_pm, None, float(t.cfg.pm_epochs))
            self.pm_trained_round = r
        if selected:
            upload = asyncio.create_task(self._upload(r, state, metrics, knowledge))
            self.uploads.add(upload)
            upload.add_done_callback(self.uploads.discard)
            if self.protocol == "compute-and-wait":
                await upload
        if (
            t.algorithm.personalized
            and self.protocol == "wait-free"
            and (selected or self.pm_trained_round is not None)
        ):
            train = functools.partial(t.train_pm, lambda: self.arrived > seen, t.cfg.pm_max_epochs, t.cfg.pm_min_steps)
            with self.timeline.phase("pm_train", r):
                await asyncio.get_running_loop().run_in_executor(self.background, train)
            self.pm_trained_round = r

    async def _upload(self, r: int, state: Any, metrics: dict[str, float], knowledge: Any) -> None:
        with self.timeline.phase("upload", r):
            n = await self.session.upload(r, state, self.trainer.num_samples, metrics, knowledge)
        self.bytes_up += n

    async def _evaluate_pm(self, model: ReceivedModel) -> None:
        """After a broadcast: the PM trained in the round it closes is evaluated and reported."""
        r = self.pm_trained_round
        if r is None or self.trainer.pm is None:
            return
        with self.timeline.phase("evaluate", r):
            acc, n = await asyncio.to_thread(self.trainer.evaluate_local, self.trainer.pm)
        self.pm_trained_round = None
        report = asyncio.create_task(self.session.report(r, {"pm_accuracy": acc, "pm_test_samples": float(n)}))
        self.reports.add(report)
        report.add_done_callback(self.reports.discard)

    async def _drain_uploads(self) -> None:
        if self.uploads or self.reports:
            await asyncio.gather(*self.uploads, *self.reports, return_exceptions=True)


def lower_thread_priority(nice: int) -> None:
    """Sets the calling thread's nice value (Linux: per thread); a no-op for 0 or elsewhere."""
    if nice <= 0 or sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as e:  # e.g. a seccomp profile that forbids it: the PM runs at normal priority
        log.warning("pm.nice_failed", nice=nice, error=str(e))


def _event(phase: str, round: int, start: float, end: float) -> Any:
    from wafl.client.timeline import PhaseEvent

    return PhaseEvent(phase, round, start, end)


async def _prefetch(models: Any, on_arrival: Callable[[], None] | None = None) -> Any:
    """Yields broadcasts; when several queued up while training, only the newest is kept.

    ``on_arrival`` is called as each complete broadcast is queued, while the consumer may still
    be busy with the previous one.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump() -> None:
        try:
            async for m in models:
                await queue.put(m)
                if on_arrival is not None:
                    on_arrival()
        except BaseException as e:  # surfaced to the consumer
            await queue.put(e)
        finally:
            await queue.put(done)

    task = asyncio.create_task(pump())
    try:
        while True:
            item = await queue.get()
            while not queue.empty():
                nxt = queue.get_nowait()
                if nxt is done or isinstance(nxt, BaseException):
                    queue.put_nowait(nxt)
                    break
                if isinstance(item, BaseException) or item is done:
                    break
                if not item.final:
                    item = nxt
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()

"""The client's round protocol: wait-free, compute-and-wait or adaptive, one code path.

Per broadcast: evaluate the PM trained in the round that just closed (and report it; a PM
evaluated on the received global part, ``pm_on_received`` as FedRep's, once the broadcast is
loaded), then, if selected, train the GM for ``local_epochs`` and

* wait-free: start the upload in the background at once and train the PM batch after batch
  until the next broadcast has been received in full (the PM keeps training while the broadcast
  streams in: stopping at its header would leave the client idle for the whole download). With
  ``pm_yield_transfers`` the PM instead starts once the upload is done and stops as the next
  broadcast's header arrives, so the client's own transfers, which the round waits for, never
  share its CPU (its quota, and Python's GIL) with the PM. The stop is checked between batches,
  so the PM stops within one batch; ``pm_min_steps``/``pm_max_epochs`` bound the loop;
* compute-and-wait: train the PM for ``pm_epochs``, then upload, then idle;
* adaptive: train ``k`` PM steps, upload, then train the PM as wait-free does until the next
  broadcast, with ``k`` the part of the round's budget (``pm_epochs`` epochs) that the client's
  predicted wait after an immediate upload would not hold (:mod:`wafl.client.adaptive`, which
  states the rule; docs/design.md, "The adaptive protocol"). Each round's decision is a ``decide``
  mark on the timeline, followed by the pre-upload ``pm_train`` when ``k > 0``, and an
  ``adaptive.decision`` log line; ``pm_min_steps`` and ``pm_max_epochs`` bound the round's PM in
  all (the pre-upload steps count towards both).

The same code serves every aggregation rule: under an asynchronous one a client receives a model
when it is asked to train on it; it uploads its difference to that model when the broadcast's
header says so (``upload_delta``, set by the server's rule), else the trained model, and it evaluates
every model it trains where the header says the rule is ``asynchronous`` (else in the rounds
``eval_every`` picks). Heterogeneous clients (``slowdown``, ``dropout``, see
:mod:`wafl.common.heterogeneity`): a slowed-down client follows each GM and compute-and-wait PM phase
with a ``slowdown`` phase of ``(factor - 1)`` times its length (its wait-free PM pauses that long after
every step), and a client that drops out of a model it was asked to train on spends the time until the
next model ``offline``.

Every phase is recorded on the client's timeline; training runs in a worker thread so the
event loop keeps streaming: the client's own threads (:class:`~wafl.client.compute.OwnThreads`),
or a slot of the shared pool of a worker process hosting many clients
(:class:`~wafl.client.compute.SharedSlots`, where the wait-free PM gives its slot up to any
federation work that waits). The wait-free PM trains in its own thread at nice ``pm_nice``
(Linux): it is there to fill time the client would otherwise idle, so it must not slow down
this client's upload or its reception of the next broadcast, which the round waits for. With
a CPU share per host (``wafl run --host-cpus``, the default of ``--link-rate`` and of ``wafl
bench protocols``) each client is a control group of its own, as on its own device, and the
nice value only ranks the client's own threads. Without quotas, nice values compare between
the processes of one session (autogroup), which is how ``wafl run`` starts its processes, so
the PM also yields to the other clients' GMs and to the server.

A new client (``new_clients``, :func:`~wafl.common.heterogeneity.new_client_indices`) runs
:class:`NewClientProtocol` instead: it trains nothing for the federation and uploads nothing. Each
model it is sent carries ``adapt`` (the global model of every evaluated round, the last one as the
final model): it adapts that model (:meth:`~wafl.client.trainer.Trainer.adapt`) for
``new_client_epochs`` epochs, tests it on its local test split and reports ``new_client_accuracy``
for the round the model closed; after the final model it sends the final report every client sends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import structlog
import torch
from wafl.client.adaptive import AdaptivePlanner, Decision
from wafl.client.compute import OwnThreads
from wafl.client.session import ReceivedModel
from wafl.client.timeline import PhaseEvent, Timeline
from wafl.client.trainer import Trainer
from wafl.common import metrics as M
from wafl.common.codec import crc32_of
from wafl.common.contract import PROTOCOLS, ClientProtocol
from wafl.common.heterogeneity import drops_out, slowdowns
from wafl.common.knowledge import Knowledge

log = structlog.get_logger("client")
_stdlib_log = logging.getLogger("client")  # the logger structlog writes ``log``'s lines to


class Transport(Protocol):
    """What the protocol needs from its connection to the server: the gRPC
    :class:`~wafl.client.session.Session` or the in-process :class:`~wafl.cli.sim.local_transport.LocalSession`."""

    client_id: str
    on_header: Callable[[], None] | None  # set by the protocol: called as each broadcast's header arrives

    def models(self) -> AsyncIterator[ReceivedModel]: ...

    async def upload(
        self,
        round: int,
        state: Mapping[str, torch.Tensor],
        num_samples: int,
        metrics: Mapping[str, float],
        knowledge: Knowledge | None = None,
    ) -> int: ...

    async def report(
        self, round: int, metrics: Mapping[str, float], timeline: list[Any] | None = None, start_unix: float = 0.0
    ) -> None: ...


class RoundProtocol:
    def __init__(self, session: Transport, trainer: Trainer, protocol: str, compute: Any = None) -> None:
        """``compute``: where the training runs (:mod:`wafl.client.compute`); default: this client's own threads."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r} is not one of {list(PROTOCOLS)}")
        self.session = session
        self.trainer = trainer
        self.protocol = ClientProtocol(protocol)
        cfg = trainer.cfg
        fed = cfg.federation
        self.slowdown = slowdowns(fed.slowdown, fed.num_clients, fed.seed)[trainer.index]
        self.timeline = Timeline()
        self.pm_trained_round: int | None = None
        self.handled = 0  # the version of the last model this client has done with (a simulation's snapshot waits)
        self.uploads: set[asyncio.Task[Any]] = set()
        self.reports: set[asyncio.Task[Any]] = set()  # PM reports, sent without holding up the next round
        self.bytes_up = 0
        self.arrived = 0  # complete broadcasts received; the wait-free PM loop watches this
        self.headers = 0  # broadcast headers received (``pm_yield_transfers``: the PM stops at the next one)
        session.on_header = self._on_header
        self.wake = asyncio.Event()  # set as a broadcast's header or its end arrives (the wait-free PM's stop)
        self.compute = compute or OwnThreads(
            self.protocol is not ClientProtocol.COMPUTE_AND_WAIT and trainer.algorithm.personalized, cfg.client.pm_nice
        )
        self.planner = AdaptivePlanner(pm_budget_steps(trainer)) if self.protocol is ClientProtocol.ADAPTIVE else None
        # adaptive: the open background window (its start on the timeline, the pre-upload PM seconds before it),
        # closed by the next broadcast's arrival (its header under pm_yield_transfers)
        self.window: tuple[float, float] | None = None

    @property
    def background(self) -> ThreadPoolExecutor | None:
        """The wait-free PM's own thread (a client alone in its process), else None."""
        return getattr(self.compute, "background", None)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.compute.close()

    async def _run(self) -> None:
        models = self.session.models()
        waiting: tuple[str, int, float] | None = None  # (idle or offline, round, since) until the next model
        async for model in _prefetch(models, self._on_arrival):
            if waiting is not None:
                self.timeline.events.append(PhaseEvent(waiting[0], waiting[1], waiting[2], self.timeline.now()))
            await self._evaluate_pm(model)
            if model.final:
                await self._drain_uploads()
                final = {
                    M.FINAL: 1.0,
                    M.BYTES_UP: float(self.bytes_up),
                    M.GLOBAL_CRC32: float(crc32_of(model.state.values())),
                }
                built = model.round - 1  # versions built: the final model is version rounds + 1
                await self.session.report(built, final, self.timeline.events, self.timeline.start_unix)
                log.info("run.final", round=built)
                return
            online = await self._round(model)
            self.handled = model.round
            waiting = ("idle" if online else "offline", model.round, self.timeline.now())
            del model  # no second copy of the weights while idle (a worker holds many clients)

    def _on_arrival(self) -> None:
        self.arrived += 1
        self._close_window()
        self.wake.set()

    def _on_header(self) -> None:
        self.headers += 1
        if self.trainer.cfg.client.pm_yield_transfers:
            self._close_window()
        self.wake.set()

    def _close_window(self) -> None:
        """Adaptive: the background window of the round that uploaded last ends as the next broadcast arrives."""
        if self.window is not None and self.planner is not None:
            start, pre_s = self.window
            self.planner.observe_window(pre_s, self.timeline.now() - start)
        self.window = None

    async def _slow_down(self, phase_s: float, round: int) -> None:
        """A slower device: the phase just measured is stretched to ``slowdown`` times its length."""
        if self.slowdown > 1.0:
            with self.timeline.phase("slowdown", round):
                await asyncio.sleep((self.slowdown - 1.0) * phase_s)

    def _pacer(self) -> Callable[[int], None] | None:
        """For the wait-free PM of a slowed-down client: each step is followed by its stretch."""
        if self.slowdown <= 1.0:
            return None
        last = [time.perf_counter()]

        def pace(_: int) -> None:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - last[0]))
            last[0] = time.perf_counter()

        return pace

    async def _round(self, model: ReceivedModel) -> bool:
        """Trains on one model as asked; returns False when the client went offline instead."""
        t = self.trainer
        cfg = t.cfg
        r = model.round  # the model's version: the round it trains in (the wire's and the timeline's round)
        seen, heads = self.arrived, self.headers
        selected = model.train
        await self.compute.run(t.begin_round, r, model.state, model.knowledge, selected)
        if t.algorithm.pm_on_received:  # the PM of the round just closed, on the global part just loaded
            await self._evaluate_pm(model, loaded=True)
        # the upload's reference when the server asks for differences (its header says), else nothing to keep
        base = model.state if model.upload_delta else None
        model.state = {}  # loaded into the local model: the received copy is freed during the round
        if selected and drops_out(cfg.federation.seed, t.index, r, cfg.federation.dropout):
            log.info("offline", round=r)
            return False
        if selected:
            cpu = _process_cpu()
            with self.timeline.phase("gm_train", r) as phase:
                gm = await self.compute.run(t.gm_round, base, cfg.evaluates_locally(r, not model.asynchronous))
            stats, knowledge, state = gm.stats, gm.knowledge, gm.state
            # only declared, finite values travel (the server refuses others): no steps, no loss
            metrics = {M.TRAIN_STEPS: float(stats.steps)}
            if math.isfinite(stats.mean_loss):
                metrics[M.TRAIN_LOSS] = stats.mean_loss
            if t.algorithm.knowledge is not None:
                metrics[M.KNOWLEDGE_RECEIVED] = float(len(model.knowledge))
            if gm.evaluated is not None and gm.evaluated[2]:  # eval_every's rounds; an empty test set has no accuracy
                kind, acc, n = gm.evaluated
                acc_key, n_key = (
                    (M.PM_ACCURACY, M.PM_TEST_SAMPLES) if kind == "pm" else (M.LOCAL_ACCURACY, M.LOCAL_TEST_SAMPLES)
                )
                metrics.update({acc_key: acc, n_key: float(n)})
            _trained("gm", r, stats.steps, phase.duration_s, _process_cpu() - cpu)
            await self._slow_down(phase.duration_s, r)
            if self.planner is not None:
                self.planner.observe_gm(phase.duration_s * max(1.0, self.slowdown), stats.steps)
        # the personal phase: after the GM (selected), or alone when the algorithm trains the personal
        # part of an unselected client on the model it received (README, "Partial participation")
        trains_pm = t.algorithm.trains_pm(selected)
        if trains_pm and self.protocol is ClientProtocol.COMPUTE_AND_WAIT and cfg.client.pm_epochs > 0:
            cpu = _process_cpu()
            with self.timeline.phase("pm_train", r) as phase:
                pm_stats = await self.compute.run(t.train_pm, None, float(cfg.client.pm_epochs))
            _trained("pm", r, pm_stats.steps, phase.duration_s, _process_cpu() - cpu)
            await self._slow_down(phase.duration_s, r)
            self.pm_trained_round = r
        pre_steps, pre_s = 0, 0.0  # adaptive: the PM steps trained before the upload, and their seconds
        if trains_pm and self.planner is not None:
            pre_steps, pre_s = await self._pm_before_upload(r, selected)
        if selected:
            upload = asyncio.create_task(self._upload(r, state, metrics, knowledge))
            self.uploads.add(upload)
            upload.add_done_callback(self.uploads.discard)
            if self.protocol is ClientProtocol.COMPUTE_AND_WAIT:
                await upload
        if trains_pm and self.protocol is not ClientProtocol.COMPUTE_AND_WAIT:
            # the client's own transfers get its CPU: PM after the upload, until a header
            if cfg.client.pm_yield_transfers:
                if selected:
                    await asyncio.wait({upload})  # its outcome is the upload task's (drained at the end)
                stop = lambda: self.headers > heads or self.arrived > seen  # noqa: E731
            else:
                stop = lambda: self.arrived > seen  # noqa: E731
            if selected and self.planner is not None and not stop():
                self.window = (self.timeline.now(), pre_s)
            max_epochs, min_steps = cfg.client.pm_max_epochs, max(0, cfg.client.pm_min_steps - pre_steps)
            if max_epochs is not None and pre_steps:  # the pre-upload steps count towards the round's cap
                max_epochs -= pre_steps / pm_steps_per_epoch(t)
            if max_epochs is None or max_epochs * pm_steps_per_epoch(t) >= 0.5:
                pacer = self._pacer()
                train = lambda should_stop: t.train_pm(should_stop, max_epochs, min_steps, pacer)  # noqa: E731
                cpu = _process_cpu()
                with self.timeline.phase("pm_train", r) as phase:
                    pm_stats = await self.compute.fill(train, stop, self.wake)
                _trained("pm", r, pm_stats.steps, phase.duration_s, _process_cpu() - cpu)
                if self.planner is not None:
                    self.planner.observe_pm(phase.duration_s, pm_stats.steps)
            self.pm_trained_round = r
        return True

    async def _pm_before_upload(self, r: int, selected: bool) -> tuple[int, float]:
        """Adaptive: the round's decision (a ``decide`` mark and a log line), then its pre-upload PM steps;
        returns their number and seconds. A client that uploads nothing (unselected) decides nothing."""
        planner = self.planner
        if planner is None or not selected:
            return 0, 0.0
        d = planner.decide(r)
        cap = self.trainer.cfg.client.pm_max_epochs
        if cap is not None:  # pm_max_epochs bounds the round's PM, the pre-upload part included
            d = _capped(d, math.floor(cap * pm_steps_per_epoch(self.trainer) + 0.5))
        now = self.timeline.now()
        self.timeline.events.append(PhaseEvent("decide", r, now, now))
        log.info(
            "adaptive.decision",
            round=r,
            pre_steps=d.pre_steps,
            budget_steps=d.budget_steps,
            step_s=None if d.step_s is None else round(d.step_s, 5),
            free_window_s=None if d.free_window_s is None else round(d.free_window_s, 4),
            rule=d.rule,
        )
        if d.pre_steps == 0:
            return 0, 0.0
        t, cpu = self.trainer, _process_cpu()
        with self.timeline.phase("pm_train", r) as phase:  # exactly pre_steps: min_steps with a stop always asked
            stats = await self.compute.run(t.train_pm, lambda: True, None, d.pre_steps, self._pacer())
        _trained("pm", r, stats.steps, phase.duration_s, _process_cpu() - cpu)
        planner.observe_pm(phase.duration_s, stats.steps, background=False)
        return stats.steps, phase.duration_s

    async def _upload(self, r: int, state: Any, metrics: dict[str, float], knowledge: Any) -> None:
        with self.timeline.phase("upload", r):
            n = await self.session.upload(r, state, self.trainer.num_samples, metrics, knowledge)
        self.bytes_up += n

    async def _evaluate_pm(self, model: ReceivedModel, loaded: bool = False) -> None:
        """After a broadcast: the PM trained in the round it closes is evaluated and reported (in a
        round that ``eval_every`` evaluates, and after the final model).

        An algorithm whose PM is evaluated on the received global part (``pm_on_received``, FedRep's
        global body with its personal head) is evaluated once ``begin_round`` has loaded the model
        (``loaded``, from :meth:`_round`); the final model, which begins no round, is loaded by the
        evaluation itself."""
        t = self.trainer
        r = self.pm_trained_round
        if r is None or t.pm is None:
            return
        on_received = t.algorithm.pm_on_received
        if on_received and not (loaded or model.final):
            return  # evaluated in _round, right after begin_round
        if not (model.final or t.cfg.evaluates_locally(r, not model.asynchronous)):
            self.pm_trained_round = None
            return
        received = model.state if on_received and not loaded else None
        with self.timeline.phase("evaluate", r):
            acc, n = await self.compute.run(t.evaluate_personal, received)
        self.pm_trained_round = None
        if not n:  # an empty local test set has no accuracy to report
            return
        report = asyncio.create_task(self.session.report(r, {M.PM_ACCURACY: acc, M.PM_TEST_SAMPLES: float(n)}))
        self.reports.add(report)
        report.add_done_callback(self.reports.discard)

    async def _drain_uploads(self) -> None:
        if self.uploads or self.reports:
            await asyncio.gather(*self.uploads, *self.reports, return_exceptions=True)


def pm_steps_per_epoch(trainer: Trainer) -> int:
    """The PM phase's steps in one epoch: its fixed ``steps`` if it has them, else one pass over its data."""
    phase = trainer.algorithm.pm_phase
    if phase is not None and phase.steps is not None:
        return max(1, phase.steps)
    data = trainer.public_idx if phase is not None and phase.data == "public" else trainer.train_idx
    return max(1, math.ceil(len(data) / trainer.cfg.training.batch_size))


def pm_budget_steps(trainer: Trainer) -> int:
    """The adaptive protocol's PM budget per round: the steps of ``pm_epochs`` epochs, compute-and-wait's amount
    (a phase with fixed ``steps`` trains them once per call, whatever the epochs)."""
    cfg, phase = trainer.cfg, trainer.algorithm.pm_phase
    if cfg.client.pm_epochs <= 0 or phase is None:
        return 0
    if phase.steps is not None:
        return max(1, phase.steps)
    return max(1, round(cfg.client.pm_epochs * pm_steps_per_epoch(trainer)))


def _capped(d: Decision, cap_steps: int) -> Decision:
    """A decision whose pre-upload steps stay within ``pm_max_epochs``'s steps."""
    if d.pre_steps <= cap_steps:
        return d
    return Decision(d.round, cap_steps, d.budget_steps, d.step_s, d.free_window_s, d.rule)


def _process_cpu() -> float:
    """The process's CPU seconds, for a phase's log line (:func:`_trained`); 0 when that line is not
    written: with other threads busy the clock costs 10-20 us a call (a simulation reads it four times
    per client and round)."""
    return time.process_time() if _stdlib_log.isEnabledFor(logging.INFO) else 0.0


def _trained(model: str, r: int, steps: int, wall_s: float, cpu_s: float) -> None:
    """One log line per training phase: its steps, wall-clock seconds and the CPU seconds the process
    used meanwhile (all its threads; in a worker, all its clients'), which tell a slower machine (more
    CPU per step) from a phase that did not get its CPU (more wall-clock per CPU second)."""
    log.info(f"{model}.trained", round=r, steps=steps, wall_s=round(wall_s, 4), process_cpu_s=round(cpu_s, 4))


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
        # BaseException: a stream the transport cancels raises CancelledError, which must reach the
        # consumer as the stream's failure, not pass for its end (this task's own cancellation, by
        # the consumer's ``finally``, comes when nobody reads the queue any more)
        except BaseException as e:
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
            box, item, nxt = [item], None, None  # while the consumer holds the model, this generator keeps no reference
            yield box.pop()
    finally:
        task.cancel()


class NewClientProtocol:
    def __init__(self, session: Transport, trainer: Trainer, compute: Any = None) -> None:
        """``compute``: where the adaptation runs (:mod:`wafl.client.compute`); default: this client's own threads."""
        self.session = session
        self.trainer = trainer
        self.timeline = Timeline()
        self.compute = compute or OwnThreads(False)
        self.adapted: list[int] = []  # the rounds whose global model it adapted

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.compute.close()

    async def _run(self) -> None:
        t = self.trainer
        async for model in self.session.models():
            r = model.round - 1  # the results line of this model: the version it was built from
            if model.adapt:
                with self.timeline.phase("evaluate", r):
                    acc, n = await self.compute.run(
                        t.adapt, model.round, model.state, model.knowledge, t.cfg.federation.new_client_epochs
                    )
                self.adapted.append(r)
                log.info("new_client.adapted", round=r, accuracy=round(acc, 6), test_samples=n)
                if n:  # an empty local test set has no accuracy to report
                    metrics = {M.NEW_CLIENT_ACCURACY: acc, M.NEW_CLIENT_TEST_SAMPLES: float(n)}
                    await self.session.report(r, metrics)
            if model.final:
                final = {M.FINAL: 1.0, M.BYTES_UP: 0.0, M.GLOBAL_CRC32: float(crc32_of(model.state.values()))}
                await self.session.report(r, final, self.timeline.events, self.timeline.start_unix)
                log.info("run.final", round=r)
                return


def client_protocol(session: Transport, trainer: Trainer, compute: Any = None) -> RoundProtocol | NewClientProtocol:
    """What runs a client: the round protocol of its configuration, or a new client's wait-and-adapt."""
    if trainer.is_new:
        return NewClientProtocol(session, trainer, compute)
    return RoundProtocol(session, trainer, trainer.cfg.client.protocol, compute)

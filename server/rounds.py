"""The run's loop, which drives time: wait for the clients -> start -> (collect -> close -> drain ->
aggregate -> evaluate -> checkpoint -> publish)* -> final model -> the clients' final reports.

It waits on events and deadlines, runs heavy work (aggregation, evaluation, encoding, zeroing sums,
checkpoints) in worker threads, and leaves every decision to the strategy (``strategies/``): which
clients are handed which version, when a collection closes, how it becomes the next model. Each version
ends in one line of the run's results.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from typing import Any

import numpy as np
import structlog
import torch
from wafl.common import metrics as M
from wafl.common.algorithms.base import split_payload
from wafl.common.config import RunConfig
from wafl.common.errors import RunAborted
from wafl.common.plateau import PlateauWatch
from wafl.common.training import evaluate
from wafl.server.accumulators import AccumulatorPool
from wafl.server.mailbox import Mailbox
from wafl.server.reports import Reports
from wafl.server.results import ResultsLog, round_
from wafl.server.roster import Roster
from wafl.server.setup import RunParts
from wafl.server.strategies import Collection, Drain, Strategy
from wafl.server.tensorboard import TensorBoardLog

log = structlog.get_logger("server")

RESUME_GRACE = 0.5  # a resumed run waits this share of round_deadline_s for every client (_wait_for_clients)


class RoundLoop:
    """Runs one run to its end. ``changed`` is set whenever an upload is committed or released (the
    strategy's conditions may have changed); ``finished`` once the final model is published.
    ``round_probe``, when set, is called in a worker thread as each round closes, before aggregation,
    with the round's number, the global model its clients trained from and its selected clients; its
    fields join the round's results line (the in-process runs' gradient dissimilarity:
    ``wafl.cli.sim.simulate``). ``between_versions``, when set, is awaited in the event loop after each
    version's results line, before the next version is published, unless the run stops there (the in-process
    runs' snapshots: ``wafl.cli.sim.resume``)."""

    def __init__(
        self,
        cfg: RunConfig,
        parts: RunParts,
        strategy: Strategy,
        pool: AccumulatorPool,
        roster: Roster,
        mailbox: Mailbox,
        reports: Reports,
        results: ResultsLog,
        plateau: PlateauWatch | None,
        tensorboard: TensorBoardLog | None,
        executor: Executor,
        checkpoint: Callable[[], Callable[[], None]],
        run_id: str,
        run_start: float,
        resumed: bool,
    ) -> None:
        self.cfg = cfg
        self.algorithm = parts.algorithm
        self.dataset = parts.dataset
        self.model = parts.model
        self.global_model = parts.global_model
        self.strategy = strategy
        self.pool = pool
        self.roster = roster
        self.mailbox = mailbox
        self.reports = reports
        self.results = results
        self.plateau = plateau
        self.tensorboard = tensorboard
        self.executor = executor
        # takes the checkpoint on the loop and returns its write (for a worker thread), when ``checkpoint`` is on
        self.checkpoint = checkpoint
        self.run_id = run_id
        self.run_start = run_start
        self.resumed = resumed  # a checkpoint was restored: the run goes on without waiting for every client
        self.changed = asyncio.Event()  # an upload was committed or released: conditions may have changed
        self.finished = asyncio.Event()
        self.adapt_due = False  # the model about to be published was evaluated: the new clients adapt it
        self.round_probe: Callable[[int, Mapping[str, torch.Tensor], list[str]], dict[str, Any]] | None = None
        self.between_versions: Callable[[], Awaitable[None]] | None = None

    def wall(self) -> float:
        return time.monotonic() - self.run_start

    async def _wait_for_clients(self) -> None:
        """The wait before the first version is handed out.

        A new run waits for every client, up to ``join_timeout_s`` (then :class:`RunAborted`). A
        resumed run (a checkpoint was restored) waits for every client at most half of
        ``round_deadline_s`` (no more than ``join_timeout_s``; :data:`RESUME_GRACE`). Then it goes on
        with the clients that are back, once they number ``min_clients`` (at least one training
        client), under the rule's own deadlines; the others join the next round or version when they
        come back. Half a deadline: the first round after the resume may itself wait a deadline for a
        client that joined and dropped out again, and the time before the kill and the server's
        downtime come on top, so that a restart costs no more than two round deadlines without
        versions as long as the server is down less than the other half; the chaos test's smoke run
        (10 s deadline) had a stall of 24.5 s with a whole deadline of wait. Live clients find the
        server again within seconds (their backoff between attempts is at most 5 s; under the 120 s
        default the wait is 60 s). Before, one client that was down while the server restarted held
        every version up until it returned, and ended the run after ``join_timeout_s``."""
        cfg = self.cfg
        roster = self.roster
        loop = asyncio.get_running_loop()
        begun = loop.time()
        grace = (
            min(RESUME_GRACE * cfg.federation.round_deadline_s, cfg.federation.join_timeout_s)
            if self.resumed
            else cfg.federation.join_timeout_s
        )
        try:
            await asyncio.wait_for(roster.all_joined.wait(), grace)
            return
        except TimeoutError:
            if not self.resumed:
                raise RunAborted(
                    f"only {len(roster.clients)} of num_clients={cfg.federation.num_clients} joined "
                    f"within join_timeout_s={cfg.federation.join_timeout_s}"
                ) from None
        needed = min(cfg.federation.min_clients or 1, cfg.federation.training_clients)
        while len(self.strategy.clients) < needed and not roster.all_joined.is_set():
            left = begun + cfg.federation.join_timeout_s - loop.time()
            if left <= 0:
                raise RunAborted(
                    f"resumed: only {len(roster.clients)} of num_clients={cfg.federation.num_clients} joined within "
                    f"join_timeout_s={cfg.federation.join_timeout_s} ({needed} training clients needed)"
                )
            roster.client_joined.clear()
            try:
                await asyncio.wait_for(roster.client_joined.wait(), left)
            except TimeoutError:
                pass
        absent = sorted(set(range(cfg.federation.num_clients)) - {c.index for c in roster.clients.values()})
        log.warning(
            "resume.partial",
            joined=len(roster.clients),
            absent_indices=absent,
            waited_s=round_(loop.time() - begun),
            reason=f"not every client joined the resumed server within {grace:g} s (half of round_deadline_s); "
            "the others join the next round or version when they come back",
        )

    async def run(self) -> None:
        await self._wait_for_clients()
        loop = asyncio.get_running_loop()
        log.info(
            "run.start",
            run_id=self.run_id,
            clients=len(self.roster.clients),
            rounds=self.cfg.federation.rounds,
            algorithm=self.cfg.training.algorithm,
            aggregation=self.cfg.rule.aggregation,
            model_bytes=self.global_model.nbytes,
        )
        await self.mailbox.publish(self.strategy.start(loop.time()))
        while not self.strategy.done:
            await self._collect()
            collection = self.strategy.close(loop.time())
            await self._drain(collection)
            await self._finish_version(collection)
            if self.plateau is not None and self.plateau.stop:
                break  # flattened: the final model now, as after the last round
            if self.between_versions is not None:
                await self.between_versions()
            deliveries = self.strategy.published(loop.time())
            if self.adapt_due and not self.strategy.done:  # the final model reaches them anyway
                deliveries = {**deliveries, **{cid: False for cid in self.roster.new_clients}}
            await self.mailbox.publish(deliveries)
        await self.mailbox.publish({cid: False for cid in self.roster.clients}, final=True)
        self.finished.set()
        log.info("run.done", wall_s=round_(self.wall()))

    def _final_progress(self) -> int:
        """Messages of final models sent plus final reports received."""
        return self.mailbox.final_messages + len(self.reports.final_reports)

    async def run_to_end(self, final_report_timeout_s: float | None = None) -> None:
        """The run, then the clients' final reports, then the last results lines. The wait for the
        reports ends ``final_report_timeout_s`` (default: the configuration's ``final_report_s``)
        after the last progress (a message of the final model handed to gRPC, a final report
        received): the final model goes to every client at once, which takes a while for thousands
        of them, and each of them reports only once it holds the whole model."""
        if final_report_timeout_s is None:
            final_report_timeout_s = self.cfg.federation.final_report_s
        await self.run()
        reports = self.reports
        while not reports.final_reported.is_set():
            progress = self._final_progress()
            try:
                await asyncio.wait_for(reports.final_reported.wait(), final_report_timeout_s)
            except TimeoutError:
                if self._final_progress() == progress:
                    log.warning(
                        "final_reports.missing", got=len(reports.final_reports), clients=len(self.roster.clients)
                    )
                    break
        self.results.close_before(self.cfg.federation.rounds + 1)
        timelines = dict(self.results.timelines)  # each client's entry is replaced by a report, never changed
        await asyncio.get_running_loop().run_in_executor(self.executor, self.results.write_timelines, timelines)
        if self.tensorboard is not None:
            self.tensorboard.timelines(self.results.timelines)
            self.tensorboard.close()

    async def _collect(self) -> None:
        """Waits until the strategy wants the current collection closed, handing out work as it asks."""
        loop = asyncio.get_running_loop()
        while True:
            self.mailbox.deliver(self.strategy.tick(loop.time()))
            if self.strategy.ready():
                return
            deadline = self.strategy.next_deadline()
            self.changed.clear()
            try:
                async with asyncio.timeout_at(deadline):  # no task per wake-up (once per upload)
                    await self.changed.wait()
            except TimeoutError:
                pass

    async def _drain(self, c: Collection) -> None:
        loop = asyncio.get_running_loop()
        if self.strategy.drain is Drain.WAIT:
            deadline = loop.time() + self.cfg.federation.round_deadline_s
            while c.in_flight and loop.time() < deadline:
                self.changed.clear()
                try:
                    await asyncio.wait_for(self.changed.wait(), deadline - loop.time())
                except TimeoutError:
                    pass
        cancelled = await loop.run_in_executor(self.executor, c.accumulator.cancel_open)
        if cancelled:
            log.warning("round.cancelled_uploads", round=c.version, count=cancelled)

    async def _finish_version(self, c: Collection) -> None:
        """Aggregates a closed collection, evaluates, checkpoints and records its results line."""
        loop = asyncio.get_running_loop()
        model = self.global_model
        probed: dict[str, Any] = {}
        if self.round_probe is not None:
            selected = sorted(getattr(self.strategy, "selected", c.metrics))
            probed = await loop.run_in_executor(self.executor, self.round_probe, c.version, model.state, selected)
        state, knowledge, fields = await loop.run_in_executor(self.executor, self.strategy.aggregate, model.state, c)
        if state is not None:
            model.state = state
        if "refused" in fields:
            log.error("round.refused", round=c.version, reason=fields["refused"])
        if knowledge is not None:
            model.knowledge = knowledge
        if self.pool.rule.adaptive:
            self.pool.norm_bound.record(c.accumulator.norms)
            if c.accumulator.clipped:
                fields = {**fields, "clipped": c.accumulator.clipped}
                log.warning("round.clipped", round=c.version, uploads=c.accumulator.clipped, bound=c.accumulator.bound)
        await loop.run_in_executor(self.executor, c.accumulator.reset)
        self.pool.give_back(c.accumulator)
        n = self.strategy.version - 1  # versions built, this one included (sync: this round)
        evaluated = self.cfg.evaluates(n)
        if evaluated:
            acc, _, loss = await loop.run_in_executor(self.executor, self._evaluate)
        else:
            acc = loss = None
        self.adapt_due = evaluated and bool(self.roster.new_clients)
        if self.cfg.output.checkpoint:
            await loop.run_in_executor(self.executor, self.checkpoint())
        r = c.version  # the results line's "round"
        self.results.close_before(r)
        row = {
            "run_id": self.run_id,
            "round": r,
            "gm_accuracy": round_(acc),
            "gm_loss": round_(loss),
            "wall_s": round_(self.wall()),
            "round_s": round_(loop.time() - c.opened_at),
            **{k: round_(v) if isinstance(v, float) else v for k, v in fields.items()},
            **probed,
            "bytes_down": self.mailbox.bytes_down,
        }
        self.mailbox.bytes_down = 0
        if self.algorithm.knowledge is not None:
            row["knowledge_classes"] = len(model.knowledge)  # travels with the next model
        if self.algorithm.privacy is not None:
            row["epsilon"] = self.algorithm.privacy(n)["epsilon_per_run"]  # a client that took part every time
        if self.plateau is not None:  # the line's own (rounded) GM accuracy; its gap and, where the run ends, why
            row.update(self.plateau.end_of_round(r, row["gm_accuracy"], evaluated, self.strategy.done))
        if self.algorithm.local_model_is_personal:
            for cid, m in c.metrics.items():
                if M.PM_ACCURACY in m:
                    self.results.add_pm(r, cid, m[M.PM_ACCURACY], int(m.get(M.PM_TEST_SAMPLES, 1)))
        # the new clients' reports on this model come after they adapted it (sent with the next publication)
        expected = self.strategy.expected_reports(c) | (self.roster.new_clients if self.adapt_due else set())
        self.results.add_round(row, expected)
        log.info("round.done", round=r, gm_accuracy=row["gm_accuracy"], clients=row["clients"], round_s=row["round_s"])

    def _evaluate(self) -> tuple[float | None, int, float | None]:
        if not self.algorithm.evaluates_global:
            return None, 0, None  # the shared tensors make no model (FedMD, FedProto, FedRep's body)
        scored = self.algorithm.server.scored(self.global_model.state)  # the global model, or FedDyn's mean
        self.model.load_state_dict(split_payload(scored)[0], strict=False)
        test_idx = np.arange(len(self.dataset.test_labels))
        return evaluate(self.model, self.dataset.test, test_idx, self.cfg.evaluation.eval_batch_size)

"""The engine: drives I/O and time for one run; its strategy (``strategies/``) makes every decision.

join -> start -> (collect -> close -> drain -> aggregate -> evaluate -> checkpoint -> publish)* ->
final model. The engine owns the global model, the clients' mailboxes and the record of the run;
it waits on events and deadlines, runs heavy work (aggregation, evaluation, encoding, zeroing
sums) in worker threads, and hands each client what the strategy decided. It knows no transport:
the gRPC service (``service.py``) and the in-process transport (``wafl.cli.sim.local_transport``) both call
:meth:`RoundEngine.join`, :meth:`RoundEngine.deliveries`, :func:`~wafl.server.upload.receive_upload`
and :meth:`RoundEngine.report`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import structlog
import torch
from wafl.common import metrics as M
from wafl.common.algorithms import registry
from wafl.common.algorithms.base import split_payload
from wafl.common.codec import CHUNK_BYTES, Manifest, RawChunk, manifest_of
from wafl.common.config import RunConfig
from wafl.common.contract import CREDENTIAL_KEY
from wafl.common.datasets import load_dataset
from wafl.common.errors import Code, Refused
from wafl.common.heterogeneity import new_client_indices
from wafl.common.jsonsafe import dumps
from wafl.common.knowledge import ClassKnowledge, Knowledge, to_proto, validate_knowledge
from wafl.common.models import build_model
from wafl.common.partition import run_shards
from wafl.common.plateau import PlateauWatch
from wafl.common.proto import federation_pb2 as pb
from wafl.common.training import evaluate
from wafl.common.wire import ChunkBatch, PreEncoded, encode_tensors, write_transfer
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.aggregation.norm_bound import NormBound, bounded
from wafl.server.aggregation.rule import Rule
from wafl.server.aggregation.spill import RetainedBytes
from wafl.server.auth import ID_PATTERN, Credentials, JoinSecrets, Presence, check_id, load_or_create_key
from wafl.server.checkpoint import CheckpointError, load_checkpoint, remove_stale_temporaries, save_checkpoint
from wafl.server.results import ResultsLog, round_
from wafl.server.strategies import Collection, Deliveries, Drain, RunAborted, make_strategy
from wafl.server.tensorboard import TensorBoardLog
from wafl.server.upload import FoldWorkers, Upload

log = structlog.get_logger("server")

__all__ = ["ClientInfo", "Publication", "RoundEngine", "RunAborted"]

MAX_KEY_CHARS = 128  # idempotency keys: 1 to 128 characters
RETRY_WAIT_S = 30.0  # a retry waits this long at most for the earlier attempt under its key to end
RESUME_GRACE = 0.5  # a resumed run waits this share of round_deadline_s for every client (_wait_for_clients)


@dataclass
class ClientInfo:
    client_id: str
    index: int
    num_samples: int


@dataclass
class Publication:
    """One global model, encoded once for every recipient."""

    version: int  # the version it is (sync: the round it opens); rounds + 1 (or plateau stop + 1) for the final one
    final: bool
    messages: list[object]  # the transfer after the header: chunk messages, knowledge, trailer
    nbytes: int


@dataclass
class Delivery:
    seq: int
    publication: Publication
    train: bool
    adapt: bool = False  # a new client's: adapt this model and report its accuracy


class RoundEngine:
    def __init__(
        self,
        cfg: RunConfig,
        out_dir: Path,
        token: str = "",
        resume: bool = False,
        enrollment: dict[int, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.token = token
        self.secrets = JoinSecrets(token, dict(enrollment or {}))
        self.algorithm = registry.resolve(cfg.algorithm, cfg.params, vars(cfg))
        torch.manual_seed(cfg.seed)
        self.dataset = load_dataset(cfg.dataset, cfg.data_dir)
        self.model = self.algorithm.build(
            build_model(
                cfg.model, self.dataset.num_classes, self.dataset.in_channels, self.dataset.image_size, cfg.code_len
            )
        )
        # what travels: the tensors of the model the algorithm shares, then its extra tensors
        self.global_state: OrderedDict[str, torch.Tensor] = self.algorithm.payload(self.model)
        self.manifest: Manifest = manifest_of(self.global_state)
        self.model_bytes = sum(s.nbytes for s in self.manifest)
        # the messages of the largest valid upload: header, one per chunk, knowledge, trailer
        self.max_upload_messages = (
            2 + self.dataset.num_classes + sum(max(1, -(-s.nbytes // CHUNK_BYTES)) for s in self.manifest)
        )
        self.global_knowledge: Knowledge = {}
        self.run_id = uuid.uuid4().hex[:12]
        self.clients: dict[str, ClientInfo] = {}
        # new clients (wafl.common.heterogeneity): joined, never in the strategy, sent each evaluated model
        self.new_indices = new_client_indices(cfg.num_clients, cfg.new_clients, cfg.seed)
        self.new_clients: set[str] = set()
        self.adapt_due = False  # the model about to be published was evaluated: the new clients adapt it
        self.index_owner: dict[int, str] = {}
        self.index_epoch: dict[int, int] = {}  # sessions that replaced an earlier one, per index (Credentials)
        self.presence = Presence()  # whether each index's session is live (a Join without its credential)
        self.accumulators: list[Accumulator] = []  # zeroed sums, ready for the next collection
        adaptive = cfg.norm_bound if cfg.clip_norm is None else 0.0
        self.rule = Rule(cfg.aggregator, cfg.trim_fraction, cfg.clip_norm, adaptive)
        self.norm_bound = NormBound(self.rule.adaptive)
        # shared by every accumulator
        self.retained = RetainedBytes.of_mb(cfg.rollback_memory_mb, cfg.rollback_upload_mb)
        self.shard_sizes = self._shard_sizes()
        self.strategy = make_strategy(cfg, self.algorithm, self.dataset.num_classes, self._accumulator)
        self.publication: Publication | None = None
        self.mailbox: dict[str, Delivery] = {}
        self.waiting: Deliveries = {}  # decided for the version being published
        self.mail: dict[str, asyncio.Event] = {}  # per client: its mailbox has a newer delivery
        self.seq = 0
        self.changed = asyncio.Event()  # an upload was committed or released: conditions may have changed
        self.all_joined = asyncio.Event()
        self.client_joined = asyncio.Event()  # a training client joined (the wait after a resume watches it)
        self.resumed = False  # a checkpoint was restored: the run goes on without waiting for every client
        self.finished = asyncio.Event()
        self.final_reports: set[str] = set()
        self.final_reported = asyncio.Event()
        self.final_progress = 0  # messages of final models sent plus final reports received
        self.final_sent: dict[str, int] = {}  # per client: messages of the final model it was sent
        self.attempts: dict[tuple[str, int, str], Upload] = {}  # open uploads by (client, version, idempotency key)
        self.bytes_down = 0
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="wafl-server")
        self.fold_workers = FoldWorkers()  # fold every upload's chunks: a bounded set of threads
        self.run_start = time.monotonic()
        self.results = ResultsLog(
            out_dir, self.run_start, latest_pm=self.strategy.latest_pm, new_clients=bool(cfg.new_clients)
        )
        self.checkpoint_path = out_dir / "checkpoint.pt"
        remove_stale_temporaries(out_dir)  # a write killed before its rename leaves one behind
        # called in a worker thread as each round closes, before aggregation, with the round's number, the
        # global model its clients trained from and its selected clients; its fields join the round's results
        # line (the in-process runs' gradient dissimilarity: wafl.cli.sim.simulate)
        self.round_probe: Callable[[int, Mapping[str, torch.Tensor], list[str]], dict[str, Any]] | None = None
        # awaited in the event loop after each version's results line, before the next one is published, unless
        # the run stops there (the in-process runs' snapshots: wafl.cli.sim.resume)
        self.between_versions: Callable[[], Awaitable[None]] | None = None
        self.tensorboard = TensorBoardLog(cfg.tensorboard, cfg) if cfg.tensorboard else None
        if self.tensorboard is not None:
            self.results.listeners.append(self.tensorboard.row)
        if resume:
            self._resume()
        # the plateau rule (plateau_window): watches the accuracy and ends the run once it flattened
        self.plateau = PlateauWatch.of(
            cfg, self.algorithm, self.results.listeners, self.results.results_path if resume else None,
            self.strategy.version - 1,
        )  # fmt: skip
        self.credentials = Credentials(
            load_or_create_key(out_dir, self.secrets.material()), self.run_id, self.index_epoch
        )
        (out_dir / "config.json").write_text(dumps(json.loads(cfg.to_json()), indent=2))
        if self.algorithm.privacy is not None:
            report = {"per_release": self.algorithm.privacy(1), "per_run": self.algorithm.privacy(cfg.rounds)}
            (out_dir / "privacy.json").write_text(dumps(report, indent=2))
            log.info(
                "privacy",
                epsilon_per_release=report["per_release"]["epsilon_per_release"],
                epsilon_per_run=report["per_run"]["epsilon_per_run"],
                delta=report["per_run"]["delta"],
                composition=report["per_run"]["composition"],
            )

    def _accumulator(self) -> Accumulator:
        acc = (
            self.accumulators.pop()
            if self.accumulators
            else Accumulator(self.manifest, rule=self.rule, retained=self.retained)
        )
        acc.set_reference(None if self.strategy.uploads_are_deltas else self.global_state)
        acc.bound = self.norm_bound.bound(self._model_norm()) if self.rule.adaptive else None
        return acc

    def _model_norm(self) -> float:
        """The L2 norm of the global model's floating-point tensors (the first round's norm bound)."""
        return math.sqrt(
            sum(
                float(t.detach().double().pow(2).sum())
                for name, t in self.global_state.items()
                if t.is_floating_point() and bounded(name)
            )
        )

    def _shard_sizes(self) -> list[int]:
        """Each client's training-set size, rebuilt from the seed as the clients build their shards
        (over what a public split leaves): the server, not the client, owns the aggregation weights."""
        cfg = self.cfg
        shards = run_shards(cfg, self.dataset.train_labels, self.algorithm.public_size)
        return [len(s) for s in shards]

    # ----------------------------------------------------------------- state
    def _resume(self) -> None:
        ck = load_checkpoint(self.checkpoint_path)
        if ck is None:
            log.info("resume.none", path=str(self.checkpoint_path))
            return
        path = self.checkpoint_path
        if ck["config"] != json.loads(self.cfg.to_json()):
            raise CheckpointError(f"checkpoint {path}: written by a different configuration")
        state = ck["global_state"]
        if not isinstance(state, dict) or manifest_of(state) != self.manifest:
            raise CheckpointError(f"checkpoint {path}: its model does not match this run's tensor manifest")
        # the checkpoint's "round": the versions built when it was written (it holds version round + 1)
        if not (isinstance(ck["round"], int) and 0 <= ck["round"] <= self.cfg.rounds and isinstance(ck["run_id"], str)):
            raise CheckpointError(f"checkpoint {path}: round or run id out of range")
        try:
            knowledge = {
                int(j): ClassKnowledge(int(j), int(k["count"]), k["rep"], k["soft"]) for j, k in ck["knowledge"].items()
            }
            validate_knowledge(knowledge, self.dataset.num_classes, self.cfg.code_len)
        except (TypeError, KeyError, ValueError, AttributeError):
            raise CheckpointError(f"checkpoint {path}: its knowledge is malformed") from None
        try:
            self.strategy.restore_uploads(ck.get("uploads", []))  # retries of them are answered as before
        except (TypeError, ValueError):
            raise CheckpointError(f"checkpoint {path}: its committed uploads are malformed") from None
        try:
            self.norm_bound.load_state_dict(ck.get("norm_history", []))
            owners = {int(i): str(c) for i, c in ck.get("index_owner", {}).items()}
            epochs = {int(i): int(e) for i, e in ck.get("index_epoch", {}).items()}
        except (TypeError, ValueError, AttributeError):
            raise CheckpointError(f"checkpoint {path}: its norm history or index owners are malformed") from None
        for i, c in owners.items():
            if not 0 <= i < self.cfg.num_clients:
                raise CheckpointError(f"checkpoint {path}: index owner {i} is outside 0..{self.cfg.num_clients - 1}")
            if not ID_PATTERN.fullmatch(c):
                raise CheckpointError(f"checkpoint {path}: index {i} has a malformed owner")
        self.index_owner = owners
        self.index_epoch.update((i, e) for i, e in epochs.items() if i in owners and e >= 0)
        for i in owners:  # restored owners re-claim their index first (Presence)
            self.presence.seen(i, time.monotonic())
        self.global_state = OrderedDict(state)
        self.algorithm.server.load_state_dict(ck["server_state"])
        self.global_knowledge = knowledge
        self.run_id = ck["run_id"]
        self.strategy.resume(ck["round"] + 1)
        self.resumed = True
        log.info("resume", round=ck["round"], run_id=self.run_id)

    def _checkpoint(self) -> None:
        n, keep = self.strategy.version - 1, self.cfg.keep_checkpoint_every  # versions built
        if keep and n % keep == 0:  # kept as it is written: the same bytes as checkpoint.pt
            self._save_checkpoint(self.out_dir / "checkpoints" / f"round-{n}.pt")
        self._save_checkpoint(self.checkpoint_path)

    def _save_checkpoint(self, path: Path) -> None:
        save_checkpoint(
            path,
            {
                "round": self.strategy.version - 1,  # versions built (the file format's name)
                "run_id": self.run_id,
                "config": json.loads(self.cfg.to_json()),
                "global_state": self.global_state,
                "server_state": self.algorithm.server.state_dict(),
                "uploads": self.strategy.committed_uploads(),
                "norm_history": self.norm_bound.state_dict(),
                "index_owner": dict(self.index_owner),  # an owned index stays its client's after --resume
                "index_epoch": dict(self.index_epoch),  # and a replaced session's credential stays replaced
                "knowledge": {
                    j: {"count": k.count, "rep": k.rep, "soft": k.soft} for j, k in self.global_knowledge.items()
                },
            },
        )

    def write_checkpoint(self, path: Path) -> None:
        """Writes the run's checkpoint, as :meth:`_checkpoint` does, to ``path`` (what ``resume`` restores)."""
        self._save_checkpoint(path)

    def wall(self) -> float:
        return time.monotonic() - self.run_start

    # ----------------------------------------------------------------- joins
    def join(self, req: pb.JoinRequest, credential: str = "") -> pb.JoinReply:
        """Registers (or re-registers) a client and returns the run's configuration with its session
        credential; raises :class:`Refused`. A registered index re-joins with its credential, its
        enrollment secret, or, once its session is not live (:class:`~wafl.server.auth.Presence`: gone,
        or never confirmed because the Join's reply was lost), with the token by the same client id,
        which starts a new session whose credential replaces the old one's."""
        check_id("client_id", req.client_id)
        resumes = bool(credential) and self.credentials.index_of(credential, req.client_id) == req.client_index
        # the secret first: an index out of range gets the answer of a bad secret, so that only a
        # caller who may join learns the range (num_clients)
        if not resumes and not self.secrets.admits(req.client_index, req.token):
            what = "enrollment secret of this client_index" if self.secrets.enrollment else "token"
            raise Refused(f"bad or missing {what}", Code.UNAUTHENTICATED)
        if not 0 <= req.client_index < self.cfg.num_clients:
            raise Refused(f"client_index {req.client_index} is outside 0..{self.cfg.num_clients - 1}")
        owner = self.index_owner.get(req.client_index)
        if owner is not None and owner != req.client_id:
            raise Refused(f"client_index {req.client_index} already belongs to another client", Code.ALREADY_EXISTS)
        live = owner is not None and self.presence.live(req.client_index, time.monotonic())
        if live and not resumes and not self.secrets.enrollment and req.num_samples > 0:
            raise Refused(
                f"client_index {req.client_index} is registered and its session is live: re-join with its session "
                f"credential (metadata {CREDENTIAL_KEY!r}), or once it has been gone for {self.presence.grace_s:g} s",
                Code.PERMISSION_DENIED,
            )
        if req.num_samples < 0:
            raise Refused(f"num_samples {req.num_samples} must be positive (or 0 to ask for the configuration only)")
        issued = ""
        if req.num_samples > 0:
            rejoin = req.client_id in self.clients
            samples = self.shard_sizes[req.client_index]  # what it declared plays no part
            self.clients[req.client_id] = ClientInfo(req.client_id, req.client_index, samples)
            self.index_owner[req.client_index] = req.client_id
            if req.client_index in self.new_indices:
                self.new_clients.add(req.client_id)  # it waits for the evaluated models: never selected
            else:
                self.strategy.join(req.client_id, req.client_index, samples)
                self.client_joined.set()
            if resumes:
                self.presence.seen(req.client_index, time.monotonic())
            else:  # a new session; by the token, the one before it (if any) no longer speaks for the index
                if owner is not None and not self.secrets.enrollment:
                    self.credentials.renew(req.client_index)
                self.presence.fresh(req.client_index)
            issued = self.credentials.issue(req.client_id, req.client_index)
            log.info(
                "client.join",
                client=req.client_id,
                index=req.client_index,
                samples=req.num_samples,
                device=req.device[:64],
                rejoin=rejoin,
                joined=len(self.clients),
            )
            if len(self.clients) >= self.cfg.num_clients:
                self.all_joined.set()
        return pb.JoinReply(
            run_id=self.run_id,
            algorithm=self.cfg.algorithm,
            config_json=self.cfg.to_json(),
            model=self.cfg.model,
            manifest=[s.to_proto() for s in self.manifest],
            round=self.strategy.version if self.publication is not None else 0,
            num_classes=self.dataset.num_classes,
            code_len=self.cfg.code_len,
            session_credential=issued,
            max_samples=self.shard_sizes[req.client_index],
        )

    def authorize(self, client_id: str, credential: str) -> None:
        """Checks that ``credential`` is the session credential of the joined client ``client_id``;
        raises :class:`Refused` (UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND)."""
        check_id("client_id", client_id)
        index = self.credentials.check(credential, client_id, self.index_owner.get)
        if client_id not in self.clients:
            raise Refused(f"unknown client_id {client_id!r}: call Join first", Code.NOT_FOUND)
        self.presence.seen(index, time.monotonic())

    def credential_holder(self, credential: str) -> int:
        """The index of the registered client a session credential belongs to; raises :class:`Refused`."""
        return self.credentials.holder(credential, self.index_owner.get)

    # ----------------------------------------------------------------- the run
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
        loop = asyncio.get_running_loop()
        begun = loop.time()
        grace = min(RESUME_GRACE * cfg.round_deadline_s, cfg.join_timeout_s) if self.resumed else cfg.join_timeout_s
        try:
            await asyncio.wait_for(self.all_joined.wait(), grace)
            return
        except TimeoutError:
            if not self.resumed:
                raise RunAborted(
                    f"only {len(self.clients)} of num_clients={cfg.num_clients} joined "
                    f"within join_timeout_s={cfg.join_timeout_s}"
                ) from None
        needed = min(cfg.min_clients or 1, cfg.training_clients)
        while len(self.strategy.clients) < needed and not self.all_joined.is_set():
            left = begun + cfg.join_timeout_s - loop.time()
            if left <= 0:
                raise RunAborted(
                    f"resumed: only {len(self.clients)} of num_clients={cfg.num_clients} joined within "
                    f"join_timeout_s={cfg.join_timeout_s} ({needed} training clients needed)"
                )
            self.client_joined.clear()
            try:
                await asyncio.wait_for(self.client_joined.wait(), left)
            except TimeoutError:
                pass
        absent = sorted(set(range(cfg.num_clients)) - {c.index for c in self.clients.values()})
        log.warning(
            "resume.partial",
            joined=len(self.clients),
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
            clients=len(self.clients),
            rounds=self.cfg.rounds,
            algorithm=self.cfg.algorithm,
            aggregation=self.cfg.aggregation,
            model_bytes=self.model_bytes,
        )
        await self._publish(self.strategy.start(loop.time()))
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
                deliveries = {**deliveries, **{cid: False for cid in self.new_clients}}
            await self._publish(deliveries)
        await self._publish({cid: False for cid in self.clients}, final=True)
        self.finished.set()
        log.info("run.done", wall_s=round_(self.wall()))

    async def run_to_end(self, final_report_timeout_s: float | None = None) -> None:
        """The run, then the clients' final reports, then the last results lines. The wait for the
        reports ends ``final_report_timeout_s`` (default: the configuration's ``final_report_s``)
        after the last progress (a message of the final model handed to gRPC, a final report
        received): the final model goes to every client at once, which takes a while for thousands
        of them, and each of them reports only once it holds the whole model."""
        if final_report_timeout_s is None:
            final_report_timeout_s = self.cfg.final_report_s
        await self.run()
        while not self.final_reported.is_set():
            progress = self.final_progress
            try:
                await asyncio.wait_for(self.final_reported.wait(), final_report_timeout_s)
            except TimeoutError:
                if self.final_progress == progress:
                    log.warning("final_reports.missing", got=len(self.final_reports), clients=len(self.clients))
                    break
        self.results.close_before(self.cfg.rounds + 1)
        await asyncio.get_running_loop().run_in_executor(self.executor, self.results.write_timelines)
        if self.tensorboard is not None:
            self.tensorboard.timelines(self.results.timelines)
            self.tensorboard.close()

    async def _collect(self) -> None:
        """Waits until the strategy wants the current collection closed, handing out work as it asks."""
        loop = asyncio.get_running_loop()
        while True:
            self._deliver(self.strategy.tick(loop.time()))
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
            deadline = loop.time() + self.cfg.round_deadline_s
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
        probed: dict[str, Any] = {}
        if self.round_probe is not None:
            selected = sorted(getattr(self.strategy, "selected", c.metrics))
            probed = await loop.run_in_executor(self.executor, self.round_probe, c.version, self.global_state, selected)
        state, knowledge, fields = await loop.run_in_executor(
            self.executor, self.strategy.aggregate, self.global_state, c
        )
        if state is not None:
            self.global_state = state
        if "refused" in fields:
            log.error("round.refused", round=c.version, reason=fields["refused"])
        if knowledge is not None:
            self.global_knowledge = knowledge
        if self.rule.adaptive:
            self.norm_bound.record(c.accumulator.norms)
            if c.accumulator.clipped:
                fields = {**fields, "clipped": c.accumulator.clipped}
                log.warning("round.clipped", round=c.version, uploads=c.accumulator.clipped, bound=c.accumulator.bound)
        await loop.run_in_executor(self.executor, c.accumulator.reset)
        self.accumulators.append(c.accumulator)
        n = self.strategy.version - 1  # versions built, this one included (sync: this round)
        evaluated = self.cfg.evaluates(n)
        if evaluated:
            acc, _, loss = await loop.run_in_executor(self.executor, self._evaluate)
        else:
            acc = loss = None
        self.adapt_due = evaluated and bool(self.new_clients)
        if self.cfg.checkpoint:
            await loop.run_in_executor(self.executor, self._checkpoint)
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
            "bytes_down": self.bytes_down,
        }
        self.bytes_down = 0
        if self.algorithm.knowledge is not None:
            row["knowledge_classes"] = len(self.global_knowledge)  # travels with the next model
        if self.algorithm.privacy is not None:
            row["epsilon"] = self.algorithm.privacy(n)["epsilon_per_run"]  # a client that took part every time
        if self.plateau is not None:  # the line's own (rounded) GM accuracy; its gap and, where the run ends, why
            row.update(self.plateau.end_of_round(r, row["gm_accuracy"], evaluated, self.strategy.done))
        if self.algorithm.local_model_is_personal:
            for cid, m in c.metrics.items():
                if M.PM_ACCURACY in m:
                    self.results.add_pm(r, cid, m[M.PM_ACCURACY], int(m.get(M.PM_TEST_SAMPLES, 1)))
        # the new clients' reports on this model come after they adapted it (sent with the next publication)
        self.results.add_round(row, self.strategy.expected_reports(c) | (self.new_clients if self.adapt_due else set()))
        log.info("round.done", round=r, gm_accuracy=row["gm_accuracy"], clients=row["clients"], round_s=row["round_s"])

    def _evaluate(self) -> tuple[float | None, int, float | None]:
        if not self.algorithm.evaluates_global:
            return None, 0, None  # the shared tensors make no model (FedMD, FedProto, FedRep's body)
        self.model.load_state_dict(split_payload(self.global_state)[0], strict=False)
        test_idx = np.arange(len(self.dataset.test_labels))
        return evaluate(self.model, self.dataset.test, test_idx, self.cfg.eval_batch_size)

    # ----------------------------------------------------------------- models to clients
    async def _publish(self, deliveries: Deliveries, final: bool = False) -> None:
        """Encodes the global model once (worker thread) and delivers it as the strategy decided."""
        loop = asyncio.get_running_loop()
        # the final model: the version after the last one built (rounds + 1, or s + 1 after a plateau stop at s)
        version = self.strategy.version
        self.publication = await loop.run_in_executor(self.executor, self._encode, version, final)
        self._deliver(deliveries)

    def _encode(self, version: int, final: bool) -> Publication:
        messages: list[object] = []
        for m in write_transfer(pb.BroadcastMessage, self.global_state.items(), to_proto(self.global_knowledge)):
            # tensors come as RawChunk / ChunkBatch (encoded once here), knowledge and trailer as messages
            messages.append(
                m if isinstance(m, pb.BroadcastMessage) else PreEncoded(encode_tensors(cast(RawChunk | ChunkBatch, m)))
            )
        return Publication(version, final, messages, self.model_bytes)

    def _deliver(self, deliveries: Deliveries) -> None:
        """Sends the current publication as decided; work handed out for a version still being
        published waits for it."""
        self.waiting.update(deliveries)
        p = self.publication
        if not self.waiting or p is None or (p.version != self.strategy.version and not p.final):
            return
        deliveries, self.waiting = self.waiting, {}
        for cid, train in deliveries.items():
            self.seq += 1
            self.mailbox[cid] = Delivery(self.seq, p, train, adapt=cid in self.new_clients)
            event = self.mail.get(cid)
            if event is not None:
                event.set()  # wakes this recipient's stream only

    async def _next_delivery(self, client_id: str, after: int) -> Delivery:
        event = self.mail.setdefault(client_id, asyncio.Event())
        while True:
            d = self.mailbox.get(client_id)
            if d is not None and d.seq > after:
                return d
            event.clear()
            await event.wait()

    async def deliveries(self, client_id: str, credential: str = "") -> AsyncIterator[object]:
        """The broadcast stream of one client: each model it is sent (its latest one first), as
        messages (header, transfer), until the final model. Raises :class:`Refused` before the first
        message for a caller that is not that joined client."""
        self.authorize(client_id, credential)
        seq = 0
        while True:
            d = await self._next_delivery(client_id, seq)
            seq = d.seq
            p = d.publication
            yield pb.BroadcastMessage(
                header=pb.BroadcastHeader(
                    run_id=self.run_id,
                    round=p.version,
                    final=p.final,
                    train=d.train,
                    adapt=d.adapt,
                    upload_delta=self.strategy.uploads_are_deltas,
                    num_tensors=len(self.manifest),
                    total_bytes=self.model_bytes,
                )
            )
            for i, m in enumerate(p.messages):
                yield m
                # the final model streams to every client at once: each message is progress, once per
                # client (a client that subscribes again and again cannot keep the server waiting)
                if p.final and i >= self.final_sent.get(client_id, 0):
                    self.final_sent[client_id] = i + 1
                    self.final_progress += 1
            self.bytes_down += p.nbytes
            if p.final:
                return

    # ----------------------------------------------------------------- uploads and reports
    async def open_upload(self, h: pb.UploadHeader, credential: str = "") -> Upload:
        """Admits an upload's header (the strategy decides); raises :class:`Refused`."""
        self.authorize(h.client_id, credential)
        if h.run_id != self.run_id:
            raise Refused(f"run_id {h.run_id[:64]!r} is not this run ({self.run_id!r})", Code.FAILED_PRECONDITION)
        if not 1 <= len(h.idempotency_key) <= MAX_KEY_CHARS:
            raise Refused(f"idempotency_key must have 1 to {MAX_KEY_CHARS} characters (got {len(h.idempotency_key)})")
        M.check(h.metrics, M.UPLOAD, "upload")
        if h.client_id in self.new_clients:
            raise Refused(
                f"client {h.client_id!r} is a new client (new_clients): it does not train", Code.FAILED_PRECONDITION
            )
        await self._after_earlier_attempt(h)
        self.strategy.check_retry(h.client_id, h.round, h.idempotency_key)  # answered for the rest of the run
        if self.finished.is_set():
            raise Refused("the run is over", Code.FAILED_PRECONDITION)
        now = asyncio.get_running_loop().time()
        ticket = self.strategy.open(h.client_id, h.round, h.num_samples, h.idempotency_key, now, h.metrics)
        upload = Upload(self, h, ticket)
        self.attempts[_attempt(h)] = upload
        return upload

    async def _after_earlier_attempt(self, h: pb.UploadHeader) -> None:
        """A retry that arrives while an earlier attempt under its key is still open (its stream's end
        not yet seen here) waits for that attempt's outcome: committed, the retry is answered OK;
        rolled back, the retry is judged as a new upload. After ``RETRY_WAIT_S``: ``UNAVAILABLE``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETRY_WAIT_S
        while (earlier := self.attempts.get(_attempt(h))) is not None:
            try:
                await asyncio.wait_for(earlier.settled.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise Refused(
                    f"an earlier upload under this idempotency_key is still streaming after {RETRY_WAIT_S:g} s; "
                    "retry under the same key",
                    Code.UNAVAILABLE,
                ) from None

    def settle(self, upload: Upload) -> None:
        """An upload attempt ended, committed or rolled back; a retry waiting for it goes on."""
        key = _attempt(upload.header)
        if self.attempts.get(key) is upload:
            del self.attempts[key]
        upload.settled.set()

    def commit(self, upload: Upload, knowledge: Knowledge | None) -> None:
        h = upload.header
        now = asyncio.get_running_loop().time()
        self._deliver(self.strategy.commit(upload.ticket, dict(h.metrics), knowledge, upload.reader.bytes, now))
        log.info("upload.accepted", client=h.client_id, round=h.round, bytes=upload.reader.bytes)
        self.changed.set()

    def release(self, upload: Upload) -> None:
        self.strategy.release(upload.ticket)
        self.changed.set()

    def report(self, req: pb.ReportRequest, credential: str = "") -> None:
        self.authorize(req.client_id, credential)
        if req.run_id != self.run_id:
            raise Refused(f"run_id {req.run_id[:64]!r} is not this run ({self.run_id!r})", Code.FAILED_PRECONDITION)
        if not 1 <= req.round <= self.cfg.rounds:
            raise Refused(f"report round {req.round} is outside 1..{self.cfg.rounds}")
        M.check(req.metrics, M.REPORT, "report")
        new = req.client_id in self.new_clients
        wrong = M.PM_ACCURACY if new else M.NEW_CLIENT_ACCURACY
        if wrong in req.metrics:
            kind = "a new client (new_clients), which has no PM" if new else "a training client, not a new one"
            raise Refused(f"report metric {wrong!r}: client {req.client_id!r} is {kind}")
        _check_timeline(req, self.cfg.rounds)
        timeline = [{"phase": e.phase, "round": e.round, "start_s": e.start_s, "end_s": e.end_s} for e in req.timeline]
        self.results.add_report(req.client_id, req.round, dict(req.metrics), timeline, req.client_start_unix or None)
        if req.metrics.get(M.FINAL, 0.0) == 1.0 and req.client_id not in self.final_reports:
            self.final_reports.add(req.client_id)
            self.final_progress += 1
            if len(self.final_reports) >= len(self.clients):
                self.final_reported.set()


def _attempt(h: pb.UploadHeader) -> tuple[str, int, str]:
    return (h.client_id, h.round, h.idempotency_key)


def _check_timeline(req: pb.ReportRequest, rounds: int) -> None:
    """A report's timeline: known phases, rounds of this run, finite times; raises :class:`Refused`."""
    if not math.isfinite(req.client_start_unix) or req.client_start_unix < 0:
        raise Refused("client_start_unix must be a finite, non-negative number")
    for e in req.timeline:
        if e.phase not in M.PHASES:
            raise Refused(f"timeline phase {e.phase[:32]!r} is not one of {', '.join(M.PHASES)}")
        if not 0 <= e.round <= rounds + 1:
            raise Refused(f"timeline round {e.round} is outside 0..{rounds + 1}")
        if not (math.isfinite(e.start_s) and math.isfinite(e.end_s) and 0 <= e.start_s <= e.end_s):
            raise Refused("timeline times must be finite with 0 <= start_s <= end_s")

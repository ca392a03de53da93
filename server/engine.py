"""The round engine: join -> (select -> broadcast -> collect -> aggregate -> evaluate ->
checkpoint)* -> final broadcast.

It owns the global model and every piece of run state; the gRPC service (``service.py``)
only translates messages and statuses. A round closes when every selected client uploaded,
or when its deadline passed with at least ``min_clients`` uploads; a deadline that passes
with fewer is extended (``max_round_retries`` times), after which the round closes with
whatever arrived, so a dead or slow client can never stall the run.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from wafl.common.algorithms import registry
from wafl.common.algorithms.hyperknowledge import ClassKnowledge, Knowledge, KnowledgeAccumulator
from wafl.common.codec import Manifest, crc32_of, iter_chunks, manifest_of
from wafl.common.config import RunConfig
from wafl.common.datasets import load_dataset
from wafl.common.models import build_model
from wafl.common.proto import federation_pb2 as pb
from wafl.common.training import evaluate
from wafl.common.wire import PreEncoded, encode_tensors, group_chunks
from wafl.server.aggregator import Accumulator
from wafl.server.checkpoint import load_checkpoint, save_checkpoint
from wafl.server.results import ResultsLog, round_
from wafl.server.selection import select_clients

log = structlog.get_logger("server")


class RunAborted(RuntimeError):
    pass


@dataclass
class ClientInfo:
    client_id: str
    index: int
    num_samples: int
    label_histogram: list[int]
    device: str
    joined_at: float


@dataclass
class Broadcast:
    """One global model, encoded once and streamed to every subscriber."""

    version: int
    header: pb.BroadcastHeader
    chunks: list[PreEncoded]
    knowledge: list[pb.ClassKnowledge]
    trailer: pb.BroadcastTrailer
    nbytes: int


@dataclass
class RoundState:
    round: int
    selected: set[str]
    accumulator: Accumulator
    deadline: float
    uploaded: dict[str, str] = field(default_factory=dict)  # client -> idempotency key
    in_flight: set[str] = field(default_factory=set)
    knowledge: KnowledgeAccumulator | None = None
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    bytes_up: int = 0
    closed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    opened_at: float = 0.0


class RoundEngine:
    def __init__(self, cfg: RunConfig, out_dir: Path, token: str = "", resume: bool = False) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.token = token
        self.algorithm = registry.resolve(cfg.algorithm, cfg.params, vars(cfg))
        torch.manual_seed(cfg.seed)
        self.dataset = load_dataset(cfg.dataset, cfg.data_dir)
        self.model = build_model(
            cfg.model, self.dataset.num_classes, self.dataset.in_channels, self.dataset.image_size, cfg.code_len
        )
        self.global_state: OrderedDict[str, torch.Tensor] = OrderedDict(
            (k, v.detach().clone()) for k, v in self.model.state_dict().items()
        )
        self.manifest: Manifest = manifest_of(self.global_state)
        self.model_bytes = sum(s.nbytes for s in self.manifest)
        self.global_knowledge: Knowledge = {}
        self.run_id = uuid.uuid4().hex[:12]
        self.clients: dict[str, ClientInfo] = {}
        self.index_owner: dict[int, str] = {}
        self.round = 0  # the round in progress; 0 before the first
        self.current: RoundState | None = None
        self.broadcast: Broadcast | None = None
        self.broadcast_changed = asyncio.Condition()
        self.all_joined = asyncio.Event()
        self.finished = asyncio.Event()
        self.final_reports: set[str] = set()
        self.final_reported = asyncio.Event()
        self.bytes_down = 0
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="wafl-server")
        self.accumulator = Accumulator(self.manifest)  # one for every round (see Accumulator.reset)
        self.run_start = time.monotonic()
        self.results = ResultsLog(out_dir, self.run_start)
        self.checkpoint_path = out_dir / "checkpoint.pt"
        self.start_round = 1
        if resume:
            self._resume()
        (out_dir / "config.json").write_text(json.dumps(json.loads(cfg.to_json()), indent=2))
        if self.algorithm.privacy is not None:
            report = {"per_release": self.algorithm.privacy(1), "per_run": self.algorithm.privacy(cfg.rounds)}
            (out_dir / "privacy.json").write_text(json.dumps(report, indent=2))
            log.info(
                "privacy",
                epsilon_per_release=report["per_release"]["epsilon_per_release"],
                epsilon_per_run=report["per_run"]["epsilon_per_run"],
                delta=report["per_run"]["delta"],
                composition=report["per_run"]["composition"],
            )

    # ----------------------------------------------------------------- state
    def _resume(self) -> None:
        ck = load_checkpoint(self.checkpoint_path)
        if ck is None:
            log.info("resume.none", path=str(self.checkpoint_path))
            return
        if ck["config"] != json.loads(self.cfg.to_json()):
            raise RunAborted(f"checkpoint {self.checkpoint_path} was written by a different configuration")
        self.global_state = OrderedDict(ck["global_state"])
        self.algorithm.server.load_state_dict(ck["server_state"])
        self.global_knowledge = ck.get("knowledge", {})
        self.run_id = ck["run_id"]
        self.start_round = ck["round"] + 1
        log.info("resume", round=ck["round"], run_id=self.run_id)

    def _checkpoint(self, round: int) -> None:
        save_checkpoint(
            self.checkpoint_path,
            {
                "round": round,
                "run_id": self.run_id,
                "config": json.loads(self.cfg.to_json()),
                "global_state": self.global_state,
                "server_state": self.algorithm.server.state_dict(),
                "knowledge": self.global_knowledge,
            },
        )

    def wall(self) -> float:
        return time.monotonic() - self.run_start

    # ----------------------------------------------------------------- joins
    def join(self, req: pb.JoinRequest) -> ClientInfo | None:
        """Registers (or re-registers) a client; raises ``PermissionError``/``KeyError``/``ValueError``."""
        if self.token and req.token != self.token:
            raise PermissionError("bad or missing token")
        if not req.client_id:
            raise ValueError("client_id is empty")
        if not 0 <= req.client_index < self.cfg.num_clients:
            raise ValueError(f"client_index {req.client_index} is outside 0..{self.cfg.num_clients - 1}")
        owner = self.index_owner.get(req.client_index)
        if owner is not None and owner != req.client_id:
            raise FileExistsError(f"client_index {req.client_index} already belongs to {owner!r}")
        if req.num_samples < 0:
            raise ValueError(f"num_samples {req.num_samples} must be positive (or 0 to ask for the configuration only)")
        if req.num_samples == 0:
            return None
        info = ClientInfo(
            req.client_id, req.client_index, req.num_samples, list(req.label_histogram), req.device, self.wall()
        )
        rejoin = req.client_id in self.clients
        self.clients[req.client_id] = info
        self.index_owner[req.client_index] = req.client_id
        log.info(
            "client.join",
            client=req.client_id,
            index=req.client_index,
            samples=req.num_samples,
            device=req.device,
            rejoin=rejoin,
            joined=len(self.clients),
        )
        if len(self.clients) >= self.cfg.num_clients:
            self.all_joined.set()
        return info

    def join_reply(self) -> pb.JoinReply:
        return pb.JoinReply(
            run_id=self.run_id,
            algorithm=self.cfg.algorithm,
            config_json=self.cfg.to_json(),
            model=self.cfg.model,
            manifest=[s.to_proto() for s in self.manifest],
            round=self.round,
            num_classes=self.dataset.num_classes,
            code_len=self.cfg.code_len,
        )

    # ----------------------------------------------------------------- rounds
    def select(self, round: int) -> set[str]:
        ids = [c.client_id for c in sorted(self.clients.values(), key=lambda c: c.index)]
        return select_clients(self.cfg.seed, round, ids, self.cfg.fraction, self.cfg.act_prob)

    async def run(self) -> None:
        try:
            await asyncio.wait_for(self.all_joined.wait(), self.cfg.join_timeout_s)
        except TimeoutError:
            raise RunAborted(
                f"only {len(self.clients)} of num_clients={self.cfg.num_clients} joined within join_timeout_s={self.cfg.join_timeout_s}"
            ) from None
        log.info(
            "run.start",
            run_id=self.run_id,
            clients=len(self.clients),
            rounds=self.cfg.rounds,
            algorithm=self.cfg.algorithm,
            model_bytes=self.model_bytes,
        )
        for r in range(self.start_round, self.cfg.rounds + 1):
            await self._round(r)
        await self._publish(self.cfg.rounds + 1, set(), final=True)
        self.finished.set()
        log.info("run.done", wall_s=round_(self.wall()))

    async def _round(self, r: int) -> None:
        loop = asyncio.get_running_loop()
        selected = self.select(r)
        await loop.run_in_executor(self.executor, self.accumulator.reset)  # faults its pages in before any upload
        state = RoundState(
            r, selected, self.accumulator, deadline=loop.time() + self.cfg.round_deadline_s, opened_at=self.wall()
        )
        if self.algorithm.knowledge is not None:
            state.knowledge = KnowledgeAccumulator(self.dataset.num_classes)
        self.current = state
        self.round = r
        await self._publish(r, selected)
        min_clients = min(self.cfg.min_clients or 1, len(selected))
        extensions = 0
        while True:
            remaining = state.deadline - loop.time()
            if remaining > 0:
                try:
                    await asyncio.wait_for(state.done.wait(), remaining)
                except TimeoutError:
                    pass
            if set(state.uploaded) >= selected:
                break
            if loop.time() >= state.deadline:
                if len(state.uploaded) >= min_clients:
                    log.warning("round.deadline", round=r, uploaded=len(state.uploaded), selected=len(selected))
                    break
                if extensions >= self.cfg.max_round_retries:
                    if not state.uploaded:
                        raise RunAborted(
                            f"round {r}: no client uploaded within {extensions + 1} deadlines of {self.cfg.round_deadline_s}s"
                        )
                    log.warning("round.closed_short", round=r, uploaded=len(state.uploaded), min_clients=min_clients)
                    break
                extensions += 1
                state.deadline = loop.time() + self.cfg.round_deadline_s
                log.warning(
                    "round.extended",
                    round=r,
                    uploaded=len(state.uploaded),
                    min_clients=min_clients,
                    extension=extensions,
                )
        state.closed = True
        cancelled = await loop.run_in_executor(self.executor, state.accumulator.cancel_open)
        if cancelled:
            log.warning("round.cancelled_uploads", round=r, count=cancelled)
        await loop.run_in_executor(self.executor, self._aggregate, state)
        every = self.cfg.eval_every
        if r == self.cfg.rounds or (every and r % every == 0):
            acc, _, loss = await loop.run_in_executor(self.executor, self._evaluate)
        else:
            acc = loss = None
        if self.cfg.checkpoint:
            await loop.run_in_executor(self.executor, self._checkpoint, r)
        self.results.close_before(r)
        row = {
            "round": r,
            "gm_accuracy": round_(acc),
            "gm_loss": round_(loss),
            "wall_s": round_(self.wall()),
            "round_s": round_(self.wall() - state.opened_at),
            "bytes_up": state.bytes_up,
            "bytes_down": self.bytes_down,
            "clients": state.accumulator.count,
            "selected": len(selected),
            "train_loss": round_(_mean([m.get("train_loss") for m in state.metrics.values()])),
        }
        self.bytes_down = 0
        if self.algorithm.knowledge is not None:
            row["knowledge_classes"] = len(self.global_knowledge)  # broadcast with the next model
            got = [m["knowledge_received"] for m in state.metrics.values() if "knowledge_received" in m]
            row["knowledge_received_min"] = min(got) if got else None
        if self.algorithm.privacy is not None:
            row["epsilon"] = self.algorithm.privacy(r)[
                "epsilon_per_run"
            ]  # a client that took part in every round so far
        for k in ("local_accuracy",):
            v = _weighted([(m.get(k), m.get("local_test_samples", 1)) for m in state.metrics.values()])
            if v is not None:
                row[k] = round_(v)
        expected: set[str] = set()
        if self.algorithm.local_model_is_personal:
            for c, m in state.metrics.items():
                if "pm_accuracy" in m:
                    self.results.reports.setdefault(r, {})[c] = (m["pm_accuracy"], int(m.get("pm_test_samples", 1)))
        elif self.algorithm.personalized:
            expected = set(state.uploaded)
        self.results.add_round(row, expected)
        log.info("round.done", round=r, gm_accuracy=row["gm_accuracy"], clients=row["clients"], round_s=row["round_s"])

    def _aggregate(self, state: RoundState) -> None:
        acc = state.accumulator
        if acc.count == 0:
            return
        mean = acc.mean()
        new = self.algorithm.server.finalize(self.global_state, mean, acc.count)
        self.global_state = OrderedDict(
            (k, new[k].detach().to(self.global_state[k].dtype).contiguous()) for k in self.global_state
        )
        if state.knowledge is not None:
            self.global_knowledge = state.knowledge.result()

    def _evaluate(self) -> tuple[float, int, float]:
        self.model.load_state_dict(self.global_state)
        test_idx = np.arange(len(self.dataset.test_labels))
        return evaluate(self.model, self.dataset.test, test_idx, self.cfg.eval_batch_size)

    async def _publish(self, round: int, selected: set[str], final: bool = False) -> None:
        loop = asyncio.get_running_loop()
        bc = await loop.run_in_executor(self.executor, self._encode_broadcast, round, selected, final)
        async with self.broadcast_changed:
            self.broadcast = bc
            self.broadcast_changed.notify_all()

    def _encode_broadcast(self, round: int, selected: set[str], final: bool) -> Broadcast:
        chunks = [PreEncoded(encode_tensors(m)) for m in group_chunks(iter_chunks(self.global_state.items()))]
        knowledge = [
            pb.ClassKnowledge(
                class_id=k.class_id, count=k.count, representation=k.rep.tolist(), soft_prediction=k.soft.tolist()
            )
            for _, k in sorted(self.global_knowledge.items())
        ]
        header = pb.BroadcastHeader(
            run_id=self.run_id,
            round=round,
            selected=sorted(selected),
            final=final,
            num_tensors=len(self.manifest),
            total_bytes=self.model_bytes,
            server_state_json="{}",
        )
        version = (self.broadcast.version + 1) if self.broadcast else 1
        return Broadcast(
            version,
            header,
            chunks,
            knowledge,
            pb.BroadcastTrailer(crc32=crc32_of(self.global_state.values())),
            self.model_bytes,
        )

    async def next_broadcast(self, after_version: int) -> Broadcast:
        async with self.broadcast_changed:
            await self.broadcast_changed.wait_for(
                lambda: self.broadcast is not None and self.broadcast.version > after_version
            )
            assert self.broadcast is not None
            return self.broadcast

    # ----------------------------------------------------------------- uploads
    def check_upload(self, h: pb.UploadHeader) -> RoundState:
        """Raises ``UploadRefused`` with a status name when the header cannot open an upload."""
        if h.run_id != self.run_id:
            raise UploadRefused("FAILED_PRECONDITION", f"run_id {h.run_id!r} is not this run ({self.run_id!r})")
        info = self.clients.get(h.client_id)
        if info is None:
            raise UploadRefused("NOT_FOUND", f"unknown client_id {h.client_id!r}: call Join first")
        state = self.current
        if state is None or self.finished.is_set():
            raise UploadRefused("FAILED_PRECONDITION", "no round is open")
        if h.round < state.round or (h.round == state.round and state.closed):
            raise UploadRefused("FAILED_PRECONDITION", f"round {h.round} is closed; the current round is {state.round}")
        if h.round > state.round:
            raise UploadRefused(
                "FAILED_PRECONDITION", f"round {h.round} has not opened; the current round is {state.round}"
            )
        if h.client_id not in state.selected:
            raise UploadRefused("FAILED_PRECONDITION", f"client {h.client_id!r} is not selected for round {h.round}")
        if h.client_id in state.uploaded:
            if h.idempotency_key and state.uploaded[h.client_id] == h.idempotency_key:
                raise UploadRefused("OK", "duplicate of an accepted upload (same idempotency key)")
            raise UploadRefused("ALREADY_EXISTS", f"client {h.client_id!r} already uploaded for round {h.round}")
        if h.client_id in state.in_flight:
            raise UploadRefused(
                "ALREADY_EXISTS", f"an upload from client {h.client_id!r} for round {h.round} is already streaming"
            )
        if not 0 < h.num_samples <= info.num_samples:
            raise UploadRefused(
                "INVALID_ARGUMENT", f"num_samples {h.num_samples} must lie in 1..{info.num_samples} (declared at Join)"
            )
        return state

    def accept(self, state: RoundState, h: pb.UploadHeader, knowledge: Knowledge | None, nbytes: int) -> None:
        state.uploaded[h.client_id] = h.idempotency_key
        state.metrics[h.client_id] = dict(h.metrics)
        state.bytes_up += nbytes
        if state.knowledge is not None and knowledge:
            state.knowledge.add(knowledge)
        if set(state.uploaded) >= state.selected:
            state.done.set()

    def report(self, req: pb.ReportRequest) -> None:
        if req.client_id not in self.clients:
            raise UploadRefused("NOT_FOUND", f"unknown client_id {req.client_id!r}: call Join first")
        timeline = [{"phase": e.phase, "round": e.round, "start_s": e.start_s, "end_s": e.end_s} for e in req.timeline]
        self.results.add_report(req.client_id, req.round, dict(req.metrics), timeline, req.client_start_unix or None)
        if req.metrics.get("final", 0.0) == 1.0:
            self.final_reports.add(req.client_id)
            if len(self.final_reports) >= len(self.clients):
                self.final_reported.set()


class UploadRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _mean(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _weighted(pairs: list[tuple[Any, Any]]) -> float | None:
    pairs = [(v, w) for v, w in pairs if v is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def decode_knowledge(messages: list[pb.ClassKnowledge]) -> Knowledge:
    out: Knowledge = {}
    for m in messages:
        if m.class_id in out:
            raise ValueError(f"class {m.class_id} appears twice in the knowledge")
        out[m.class_id] = ClassKnowledge(
            m.class_id,
            m.count,
            torch.tensor(list(m.representation), dtype=torch.float32),
            torch.tensor(list(m.soft_prediction), dtype=torch.float32),
        )
    return out

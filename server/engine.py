"""The engine: one run's server, composed of parts with one job each; its strategy (``strategies/``)
makes every decision.

* set-up (``setup.py``): the algorithm, dataset and model, the run folder's ``config.json``,
  ``privacy.json`` and credential key, the checkpoints and the resume from one;
* the roster (``roster.py``): joins, session credentials, the clients joined;
* the mailbox (``mailbox.py``): each global model encoded once and delivered to the clients;
* the upload registry (``upload_registry.py``): uploads admitted, their open attempts, commit and
  rollback; an upload (``upload.py``) knows it only as its :class:`~wafl.server.upload.UploadHost`;
* the reports (``reports.py``);
* the round loop (``rounds.py``): join -> start -> (collect -> close -> drain -> aggregate ->
  evaluate -> checkpoint -> publish)* -> final model;
* what they share: the global model (``global_model.py``), the accumulators (``accumulators.py``).

It knows no transport: the gRPC service (``service.py``) and the in-process transport
(``wafl.cli.sim.local_transport``) both call :meth:`RoundEngine.join`, :meth:`RoundEngine.deliveries`,
:func:`~wafl.server.upload.receive_upload` (on :attr:`RoundEngine.uploads`) and :meth:`RoundEngine.report`.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from wafl.common.config import RunConfig
from wafl.common.heterogeneity import new_client_indices
from wafl.common.plateau import PlateauWatch
from wafl.common.proto import federation_pb2 as pb
from wafl.server.accumulators import AccumulatorPool
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.auth import JoinSecrets, Presence
from wafl.server.checkpoint import save_checkpoint
from wafl.server.mailbox import Mailbox
from wafl.server.reports import Reports
from wafl.server.results import ResultsLog
from wafl.server.roster import Roster
from wafl.server.rounds import RoundLoop
from wafl.server.setup import Checkpoints, build, run_credentials, write_run_files
from wafl.server.strategies import make_strategy
from wafl.server.tensorboard import TensorBoardLog
from wafl.server.upload import FoldWorkers
from wafl.server.upload_registry import UploadRegistry

__all__ = ["RoundEngine"]


class RoundEngine:
    """Sets one run up (a new one, or a resumed one with ``resume``), builds its parts in order and
    answers the transports' calls by handing each to the part that does it."""

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
        parts = build(cfg)
        self.algorithm, self.dataset, self.model = parts.algorithm, parts.dataset, parts.model
        self.global_model = parts.global_model
        self.manifest = self.global_model.manifest
        self.model_bytes = self.global_model.nbytes
        self.max_upload_messages = parts.max_upload_messages
        self.run_id = uuid.uuid4().hex[:12]
        # new clients (wafl.common.heterogeneity): joined, never in the strategy, sent each evaluated model
        new_indices = new_client_indices(cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed)
        self.presence = Presence()  # whether each index's session is live (a Join without its credential)
        self.pool = AccumulatorPool(cfg, self.global_model)
        self.strategy = make_strategy(cfg, self.algorithm, self.dataset.num_classes, self._new_accumulator)
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="wafl-server")
        self.fold_workers = FoldWorkers()  # fold every upload's chunks: a bounded set of threads
        run_start = time.monotonic()
        self.results = ResultsLog(
            out_dir, run_start, latest_pm=self.strategy.latest_pm, new_clients=bool(cfg.federation.new_clients)
        )
        self.checkpoints = Checkpoints(
            cfg,
            out_dir,
            algorithm=self.algorithm,
            num_classes=self.dataset.num_classes,
            strategy=self.strategy,
            model=self.global_model,
            norm_bound=self.pool.norm_bound,
        )
        tensorboard = TensorBoardLog(cfg.output.tensorboard, cfg) if cfg.output.tensorboard else None
        if tensorboard is not None:
            self.results.listeners.append(tensorboard.row)
        restored = self.checkpoints.restore(self.presence) if resume else None
        if restored is not None:
            self.run_id = restored.run_id
        # the plateau rule (plateau_window): watches the accuracy and ends the run once it flattened
        plateau = PlateauWatch.of(
            cfg, self.algorithm, self.results.listeners, self.results.results_path if resume else None,
            self.strategy.version - 1,
        )  # fmt: skip
        epochs = {} if restored is None else restored.index_epoch
        credentials = run_credentials(out_dir, self.secrets, self.run_id, epochs)
        write_run_files(cfg, out_dir, self.algorithm)
        self.roster = Roster(
            cfg,
            self.secrets,
            credentials,
            self.presence,
            self.strategy,
            shard_sizes=parts.shard_sizes,
            new_indices=new_indices,
            index_owner=None if restored is None else restored.index_owner,
        )
        self.mailbox = Mailbox(self.global_model, self.strategy, self.roster, self.run_id, self.executor)
        self.reports = Reports(cfg, self.roster, self.results, self.run_id)
        self.rounds = RoundLoop(
            cfg,
            parts,
            self.strategy,
            pool=self.pool,
            roster=self.roster,
            mailbox=self.mailbox,
            reports=self.reports,
            results=self.results,
            plateau=plateau,
            tensorboard=tensorboard,
            executor=self.executor,
            checkpoint=self._checkpoint,
            run_id=self.run_id,
            run_start=run_start,
            resumed=restored is not None,
        )
        self.uploads = UploadRegistry(
            cfg,
            self.run_id,
            self.roster,
            self.strategy,
            mailbox=self.mailbox,
            manifest=self.manifest,
            num_classes=self.dataset.num_classes,
            takes_knowledge=self.algorithm.knowledge is not None,
            fold_workers=self.fold_workers,
            executor=self.executor,
            changed=self.rounds.changed,
            finished=self.rounds.finished,
        )

    @property
    def global_state(self) -> OrderedDict[str, torch.Tensor]:
        """The global model's tensors as they are now."""
        return self.global_model.state

    def _new_accumulator(self) -> Accumulator:
        """The strategy's zeroed sums, for uploads of its kind (differences or whole models)."""
        return self.pool.take(self.strategy.uploads_are_deltas)

    def _checkpoint(self) -> Callable[[], None]:
        """Takes the checkpoint of the versions built so far (on the event loop, :meth:`Checkpoints.state
        <wafl.server.setup.Checkpoints.state>`) and returns its write, which the round loop runs in a worker
        thread."""
        state = self.checkpoints.state(self.run_id, self.roster.index_owner, self.roster.index_epoch)
        return functools.partial(self.checkpoints.save, state)

    def write_checkpoint(self, path: Path) -> None:
        """Writes the run's checkpoint, as the round loop's does, to ``path`` (what ``resume`` restores)."""
        save_checkpoint(path, self.checkpoints.state(self.run_id, self.roster.index_owner, self.roster.index_epoch))

    # ----------------------------------------------------------------- the transports' calls
    def join(self, req: pb.JoinRequest, credential: str = "") -> pb.JoinReply:
        """Registers (or re-registers) a client (:meth:`Roster.join <wafl.server.roster.Roster.join>`) and
        returns the run's configuration with its session credential; raises :class:`Refused`."""
        issued = self.roster.join(req, credential)
        return pb.JoinReply(
            run_id=self.run_id,
            algorithm=self.cfg.training.algorithm,
            config_json=self.cfg.to_json(),
            model=self.cfg.training.model,
            manifest=[s.to_proto() for s in self.manifest],
            round=self.strategy.version if self.mailbox.publication is not None else 0,
            num_classes=self.dataset.num_classes,
            code_len=self.cfg.training.code_len,
            session_credential=issued,
            max_samples=self.roster.shard_sizes[req.client_index],
        )

    def authorize(self, client_id: str, credential: str) -> None:
        """Checks that ``credential`` is the session credential of the joined client ``client_id``;
        raises :class:`Refused` (UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND)."""
        self.roster.authorize(client_id, credential)

    def credential_holder(self, credential: str) -> int:
        """The index of the registered client a session credential belongs to; raises :class:`Refused`."""
        return self.roster.credential_holder(credential)

    def deliveries(self, client_id: str, credential: str = "") -> AsyncIterator[object]:
        """The broadcast stream of one client (:meth:`Mailbox.deliveries <wafl.server.mailbox.Mailbox.deliveries>`)."""
        return self.mailbox.deliveries(client_id, credential)

    def report(self, req: pb.ReportRequest, credential: str = "") -> None:
        """Records a client's report; raises :class:`Refused`."""
        self.reports.report(req, credential)

    async def run(self) -> None:
        """The run, to its final model."""
        await self.rounds.run()

    async def run_to_end(self, final_report_timeout_s: float | None = None) -> None:
        """The run, then the clients' final reports, then the last results lines
        (:meth:`RoundLoop.run_to_end <wafl.server.rounds.RoundLoop.run_to_end>`)."""
        await self.rounds.run_to_end(final_report_timeout_s)

"""A run's set-up and its state in the run folder.

:func:`build` makes what the configuration describes: the algorithm, the dataset, the model (seeded), the
global model that travels and each client's shard size. The run folder holds ``config.json`` and
``privacy.json`` (:func:`write_run_files`), the salt of the credential key (``server.key``,
:func:`run_credentials`) and the checkpoints (:class:`Checkpoints`: written after each version, read back
into the run's pieces by ``--resume``). Every run sets up here, over gRPC (``app.py``, which only serves
the engine) or in process (``wafl.cli.sim``).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from wafl.common.algorithms import registry
from wafl.common.algorithms.base import Algorithm
from wafl.common.codec import CHUNK_BYTES, manifest_of
from wafl.common.config import RunConfig
from wafl.common.datasets import load_dataset
from wafl.common.datasets.base import FederatedDataset
from wafl.common.jsonsafe import dumps
from wafl.common.knowledge import ClassKnowledge, validate_knowledge
from wafl.common.models import build_model
from wafl.common.models.base import SplitModel
from wafl.common.partition import run_shards
from wafl.server.aggregation.norm_bound import NormBound
from wafl.server.auth import ID_PATTERN, Credentials, JoinSecrets, Presence, load_or_create_key
from wafl.server.checkpoint import CheckpointError, load_checkpoint, remove_stale_temporaries, save_checkpoint
from wafl.server.global_model import GlobalModel
from wafl.server.strategies import Strategy

log = structlog.get_logger("server")


@dataclass
class RunParts:
    """What a run's configuration builds before any client joins."""

    algorithm: Algorithm
    dataset: FederatedDataset
    model: SplitModel  # the algorithm's model: the global model is evaluated in it
    global_model: GlobalModel  # its initial tensors
    max_upload_messages: int  # the messages of the largest valid upload: header, one per chunk, knowledge, trailer
    shard_sizes: list[int]  # each client index's training-set size


def build(cfg: RunConfig) -> RunParts:
    """The algorithm, the dataset and the model, built after seeding torch with ``seed`` (the initial global
    model of a seed is always the same), and what follows from them."""
    algorithm = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
    torch.manual_seed(cfg.federation.seed)
    dataset = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    model = algorithm.build(
        build_model(
            cfg.training.model, dataset.num_classes, dataset.in_channels, dataset.image_size, cfg.training.code_len
        )
    )
    # what travels: the tensors of the model the algorithm shares, then its extra tensors
    global_model = GlobalModel.of(algorithm.payload(model))
    max_upload_messages = (
        2 + dataset.num_classes + sum(max(1, -(-s.nbytes // CHUNK_BYTES)) for s in global_model.manifest)
    )
    return RunParts(algorithm, dataset, model, global_model, max_upload_messages, shard_sizes(cfg, dataset, algorithm))


def shard_sizes(cfg: RunConfig, dataset: FederatedDataset, algorithm: Algorithm) -> list[int]:
    """Each client's training-set size, rebuilt from the seed as the clients build their shards
    (over what a public split leaves): the server, not the client, owns the aggregation weights."""
    shards = run_shards(cfg, dataset.train_labels, algorithm.public_size)
    return [len(s) for s in shards]


def write_run_files(cfg: RunConfig, out_dir: Path, algorithm: Algorithm) -> None:
    """``config.json`` (the whole configuration) and, for an algorithm with a privacy guarantee,
    ``privacy.json`` (per release and per run; logged as ``privacy``)."""
    (out_dir / "config.json").write_text(dumps(json.loads(cfg.to_json()), indent=2))
    if algorithm.privacy is not None:
        report = {"per_release": algorithm.privacy(1), "per_run": algorithm.privacy(cfg.federation.rounds)}
        (out_dir / "privacy.json").write_text(dumps(report, indent=2))
        log.info(
            "privacy",
            epsilon_per_release=report["per_release"]["epsilon_per_release"],
            epsilon_per_run=report["per_run"]["epsilon_per_run"],
            delta=report["per_run"]["delta"],
            composition=report["per_run"]["composition"],
        )


def run_credentials(out_dir: Path, secrets: JoinSecrets, run_id: str, epochs: dict[int, int]) -> Credentials:
    """The run's session credentials, under the key derived from ``secrets`` and the salt kept in the run
    folder (``server.key``, created on first use): the same after ``--resume`` with the same secrets.
    ``epochs`` (shared, not copied) counts the sessions that replaced an earlier one, per index."""
    return Credentials(load_or_create_key(out_dir, secrets.material()), run_id, epochs)


@dataclass
class Restored:
    """What a resume restored besides the pieces it wrote into: the run, and who owned each index."""

    round: int  # versions built when the checkpoint was written
    run_id: str
    index_owner: dict[int, str]
    index_epoch: dict[int, int]


class Checkpoints:
    """The run's checkpoints: ``checkpoint.pt`` after each version (and a copy in ``checkpoints/round-<n>.pt``
    every ``keep_checkpoint_every`` versions), and the resume that reads ``checkpoint.pt`` back into the
    run's pieces: its global model, the algorithm's server state, the strategy's version and committed
    uploads, the norm bound's history, the owners of the indices."""

    def __init__(
        self,
        cfg: RunConfig,
        out_dir: Path,
        algorithm: Algorithm,
        num_classes: int,
        strategy: Strategy,
        model: GlobalModel,
        norm_bound: NormBound,
    ) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.algorithm = algorithm
        self.num_classes = num_classes
        self.strategy = strategy
        self.model = model
        self.norm_bound = norm_bound
        self.path = out_dir / "checkpoint.pt"
        remove_stale_temporaries(out_dir)  # a write killed before its rename leaves one behind

    def restore(self, presence: Presence) -> Restored | None:
        """Reads ``checkpoint.pt`` back (None when there is none); raises :class:`CheckpointError` for one
        that is not this run's or is malformed. The restored owners are marked live in ``presence``, so
        that they re-claim their index first."""
        ck = load_checkpoint(self.path)
        if ck is None:
            log.info("resume.none", path=str(self.path))
            return None
        path = self.path
        if ck["config"] != json.loads(self.cfg.to_json()):
            raise CheckpointError(f"checkpoint {path}: written by a different configuration")
        state = ck["global_state"]
        if not isinstance(state, dict) or manifest_of(state) != self.model.manifest:
            raise CheckpointError(f"checkpoint {path}: its model does not match this run's tensor manifest")
        # the checkpoint's "round": the versions built when it was written (it holds version round + 1)
        if not (
            isinstance(ck["round"], int)
            and 0 <= ck["round"] <= self.cfg.federation.rounds
            and isinstance(ck["run_id"], str)
        ):
            raise CheckpointError(f"checkpoint {path}: round or run id out of range")
        try:
            knowledge = {
                int(j): ClassKnowledge(int(j), int(k["count"]), k["rep"], k["soft"]) for j, k in ck["knowledge"].items()
            }
            validate_knowledge(knowledge, self.num_classes, self.cfg.training.code_len)
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
            if not 0 <= i < self.cfg.federation.num_clients:
                raise CheckpointError(
                    f"checkpoint {path}: index owner {i} is outside 0..{self.cfg.federation.num_clients - 1}"
                )
            if not ID_PATTERN.fullmatch(c):
                raise CheckpointError(f"checkpoint {path}: index {i} has a malformed owner")
        restored = Restored(
            ck["round"], ck["run_id"], owners, {i: e for i, e in epochs.items() if i in owners and e >= 0}
        )
        for i in owners:  # restored owners re-claim their index first (Presence)
            presence.seen(i, time.monotonic())
        self.model.state = OrderedDict(state)
        self.algorithm.server.load_state_dict(ck["server_state"])
        self.model.knowledge = knowledge
        self.strategy.resume(ck["round"] + 1)
        log.info("resume", round=ck["round"], run_id=restored.run_id)
        return restored

    def state(self, run_id: str, index_owner: dict[int, str], index_epoch: dict[int, int]) -> dict[str, Any]:
        """The checkpoint of the versions built so far, as plain containers of its own: taken on the event loop,
        whose handlers change the committed uploads and the index owners while a version is built (a buffered
        run's uploads go on arriving), so that :meth:`save` can write it from a worker thread. The tensors are
        the model's and the server state's, which only the aggregation changes, and the round loop awaits the
        write before it aggregates again."""
        return {
            "round": self.strategy.version - 1,  # versions built (the file format's name)
            "run_id": run_id,
            "config": json.loads(self.cfg.to_json()),
            "global_state": self.model.state,
            "server_state": self.algorithm.server.state_dict(),
            "uploads": self.strategy.committed_uploads(),
            "norm_history": self.norm_bound.state_dict(),
            "index_owner": dict(index_owner),  # an owned index stays its client's after --resume
            "index_epoch": dict(index_epoch),  # and a replaced session's credential stays replaced
            "knowledge": {j: {"count": k.count, "rep": k.rep, "soft": k.soft} for j, k in self.model.knowledge.items()},
        }

    def save(self, state: dict[str, Any]) -> None:
        """Writes ``state`` (:meth:`state`) to ``checkpoint.pt`` (and, every ``keep_checkpoint_every`` versions,
        its copy); the file work of a worker thread."""
        n, keep = state["round"], self.cfg.output.keep_checkpoint_every  # versions built
        if keep and n % keep == 0:  # kept as it is written: the same bytes as checkpoint.pt
            save_checkpoint(self.out_dir / "checkpoints" / f"round-{n}.pt", state)
        save_checkpoint(self.path, state)

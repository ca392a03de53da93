"""A client's models and local data; every method here runs in a worker thread.

It holds the local model (the GM: the tensors the algorithm shares are loaded from each
broadcast and uploaded, the others stay here) and, for personalized algorithms with a separate
personal model, the PM (never uploaded). The PM, the model's part that does not travel and the
algorithm's client state are kept across rounds and across restarts in ``state_dir`` (with the
PM's optimizer state, so its momentum or Adam moments carry on after a restart). Training
runs the algorithm's declared phases through the one shared trainer
(:func:`wafl.common.training.train_phase`).
"""

from __future__ import annotations

import copy
import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from wafl.client.residency import relocate
from wafl.common.algorithms import registry
from wafl.common.algorithms.base import Algorithm, Phase, RoundContext, extra_name, parameters_of, split_payload
from wafl.common.choices import DeviceKind
from wafl.common.config import ConfigError, RunConfig
from wafl.common.datasets import FederatedDataset, load_dataset
from wafl.common.errors import InvariantError, TrainingDiverged
from wafl.common.heterogeneity import new_client_indices
from wafl.common.models import build_model
from wafl.common.partition import client_shard, public_split
from wafl.common.training import (
    Batch,
    PhaseStats,
    batches,
    clip_before_step,
    decay_lr,
    epochs,
    evaluate,
    make_optimizer,
    train_phase,
)
from wafl.common.verified import load_verified, save_verified

STATE_MAGIC = b"WAFL-CLIENT-STATE-1\n"  # a client state file (wafl.common.verified)


@dataclass
class GmRound:
    """What a selected client's GM phase gives its upload (:meth:`Trainer.gm_round`)."""

    stats: PhaseStats  # the local phases' steps and loss
    knowledge: Any  # what the algorithm shares beside the model (None: nothing)
    # the client's own model tested on its local test split when asked: ("pm" or "local", accuracy, test samples)
    evaluated: tuple[str, float, int] | None
    state: OrderedDict[str, torch.Tensor]  # the upload's tensors (:meth:`Trainer.gm_upload_state`)


def resolve_device(name: str) -> torch.device:
    if name == DeviceKind.AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available on this machine")
    return dev


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        index: int,
        state_dir: Path | None = None,
        data_dir: str | None = None,
        device: str | None = None,
        dataset: FederatedDataset | None = None,
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.device = resolve_device(device or cfg.training.device)
        self.algorithm: Algorithm = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
        self.data = dataset or load_dataset(cfg.data.dataset, data_dir or cfg.data.data_dir)
        self.public_idx = np.zeros(0, dtype=np.int64)
        if self.algorithm.public_size:
            self.public_idx = public_split(self.data.train_labels, self.algorithm.public_size, cfg.federation.seed)[0]
        shard = client_shard(
            self.data.train_labels,
            self.data.test_labels,
            cfg.federation.num_clients,
            cfg.data.partition,
            cfg.data.alpha,
            cfg.data.delta,
            cfg.federation.seed,
            index,
            cfg.data.local_test_fraction,
            cfg.data.client_size,
            self.algorithm.public_size,
        )
        self.train_idx = shard.train
        self.test_idx = shard.test
        counts = np.bincount(self.data.train_labels[self.train_idx], minlength=self.data.num_classes)
        self.label_freq = torch.as_tensor(counts / counts.sum(), dtype=torch.float32, device=self.device)
        self.label_counts = torch.as_tensor(counts, dtype=torch.float32)
        torch.manual_seed(cfg.federation.seed)  # every process starts from the same initial weights
        self.gm = self.algorithm.build(
            build_model(
                cfg.training.model,
                self.data.num_classes,
                self.data.in_channels,
                self.data.image_size,
                cfg.training.code_len,
            )
        ).to(self.device)
        algo = self.algorithm
        self.local_keys = [k for k in self.gm.state_dict() if not algo.shares(k)]  # never travel
        self.extra_names = list(algo.extras(self.gm)) if algo.extras is not None else []
        # the personal model: a separate copy, the local model itself (trained by a personal phase), or none
        self.pm = copy.deepcopy(self.gm) if algo.personal == "separate" else None
        if algo.personal == "local" and algo.pm_phase is not None:
            self.pm = self.gm
        self.pm_initialized = False
        self.client_state: dict[str, Any] = {}
        self.rng = np.random.default_rng([cfg.federation.seed, 6, index])
        self.generator = torch.Generator().manual_seed(cfg.federation.seed * 1000 + index)
        self.state_path = (state_dir / f"client-{index}.pt") if state_dir is not None else None
        self._started: tuple[Any, ...] | None = None  # the latest round begun, and what it began from
        self.ctx: RoundContext | None = None
        self.pm_optimizer: torch.optim.Optimizer | None = None  # kept across rounds: the PM's training never restarts
        self._pm_optimizer_state: dict[str, Any] | None = None  # loaded from state_dir, applied on first use
        self.pm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._offloaded: list[torch.Tensor] | None = None  # what offload() moved to the host, outside the models
        # a new client (new_clients) adapts every evaluated global model from this same start: its initial
        # non-travelling tensors (FedRep's head, FedRoD's personal head)
        self.is_new = index in new_client_indices(
            cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed
        )
        gm_state = self.gm.state_dict()
        self._fresh_local = {k: gm_state[k].detach().clone() for k in self.local_keys} if self.is_new else {}
        self._load_state()

    @property
    def num_samples(self) -> int:
        return int(len(self.train_idx))

    # -------------------------------------------------------------- rounds
    @property
    def separate_pm(self) -> bool:
        return self.pm is not None and self.pm is not self.gm

    def begin_round(
        self, round: int, global_state: Mapping[str, torch.Tensor], knowledge: Any = None, selected: bool = True
    ) -> RoundContext:
        self._round_start(round)
        state, extras = self._load_received(global_state)
        if self.pm is not None and self.separate_pm and (not self.pm_initialized or self.algorithm.pm_from_global):
            self.pm.load_state_dict(self.gm.state_dict())  # the PM starts equal to the (first) global model
            self.pm_initialized = True
            if self.algorithm.pm_from_global:
                self.pm_optimizer = None  # fine-tuning starts afresh from each global model
                self._pm_optimizer_state = None
        self.ctx = RoundContext(
            round,
            state,
            self.gm,
            self.pm,
            self.label_freq,
            self.client_state,
            knowledge,
            extras,
            selected,
            self.public_batches if self.algorithm.public_size else None,
            self.index,
            self.label_counts,
        )
        self.algorithm.hooks.begin(self.ctx)
        return self.ctx

    def _load_received(
        self, global_state: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Loads a received model's shared tensors into the local model; returns ``(model tensors, extras)``."""
        state, extras = split_payload({k: v.to(self.device) for k, v in global_state.items()})
        missing, unexpected = self.gm.load_state_dict(state, strict=False)
        if unexpected or sorted(missing) != sorted(self.local_keys):
            raise ValueError(f"received model tensors do not match the algorithm's: {missing} {unexpected}")
        return state, extras

    def _optimizer(self, params: list[torch.nn.Parameter], phase: Phase | None = None) -> torch.optim.Optimizer:
        t = self.cfg.training
        if phase is not None and phase.optimizer is not None:
            opt = phase.optimizer(params)
        else:
            opt = make_optimizer(t.optimizer, params, t.lr, t.momentum, t.weight_decay)
        return decay_lr(clip_before_step(opt, t.grad_clip), t.lr_decay, self._context().round)

    def public_batches(self, batch_size: int | None = None, shuffle: bool = False) -> Iterator[Batch]:
        """One pass over the public split as ``(x, position in the public split)``."""
        pos = np.arange(len(self.public_idx))
        if shuffle:
            pos = self.rng.permutation(pos)
        bs = batch_size or self.cfg.evaluation.eval_batch_size
        for start in range(0, len(pos), bs):
            part = pos[start : start + bs]
            x, _ = next(batches(self.data.train, self.public_idx[part], len(part), False, device=self.device))
            yield x, torch.as_tensor(part, dtype=torch.int64, device=self.device)

    def _data(self, phase: Phase, num_epochs: float | None) -> Iterator[Batch]:
        if phase.data == "public":

            def passes() -> Iterator[Batch]:
                while True:
                    yield from self.public_batches(self.cfg.training.batch_size, shuffle=True)

            per_epoch = max(1, -(-len(self.public_idx) // self.cfg.training.batch_size))
            limit = phase.steps if phase.steps is not None else max(1, round((num_epochs or 1) * per_epoch))
            return itertools.islice(passes(), limit)
        if phase.steps is not None:
            return itertools.islice(
                epochs(self.data.train, self.train_idx, self.cfg.training.batch_size, self.rng, None, self.device),
                phase.steps,
            )
        return epochs(self.data.train, self.train_idx, self.cfg.training.batch_size, self.rng, num_epochs, self.device)

    def _context(self) -> RoundContext:
        """The current round's context; raises :class:`InvariantError` before the first :meth:`begin_round`."""
        if self.ctx is None:
            raise InvariantError("no round has begun on this trainer (begin_round was not called)")
        return self.ctx

    def train_gm(self, num_epochs: float | None = None) -> PhaseStats:
        """The algorithm's local phases, in order, on the local model; a phase without its own epochs runs
        ``num_epochs`` (default: the run's ``local_epochs``)."""
        ctx, phases = self._context(), self.algorithm.phases
        if phases is None:
            raise InvariantError(f"algorithm {self.algorithm.name!r} has no local phases to train the local model with")
        stats = PhaseStats()
        for phase in phases:
            if phase.when is not None and not phase.when(ctx):
                continue
            default = num_epochs if num_epochs is not None else self.cfg.training.local_epochs
            data = self._data(phase, phase.epochs if phase.epochs is not None else default)
            opt = self._optimizer(parameters_of(self.gm, phase.params), phase)
            stats = stats.add(train_phase(self.gm, phase, ctx, data, opt))
        if self.client_state or self.local_keys:
            self.save_state()  # client state the phases updated (FedDyn's g_k), the part that does not travel
        return stats

    def train_pm(
        self,
        should_stop: Callable[[], bool] | None = None,
        num_epochs: float | None = None,
        min_steps: int = 0,
        on_step: Callable[[int], None] | None = None,
    ) -> PhaseStats:
        """Trains the PM for ``num_epochs`` (None: until ``should_stop``), on its own CUDA stream on a GPU;
        ``on_step`` runs after every step (a slowed-down client's pacing)."""
        ctx, pm, phase = self._context(), self.pm, self.algorithm.pm_phase
        if pm is None or phase is None:
            raise InvariantError(f"algorithm {self.algorithm.name!r} has no personal model and phase to train")
        data = self._data(phase, num_epochs)
        if self.pm_optimizer is None:
            self.pm_optimizer = self._optimizer(parameters_of(pm, phase.params), phase)
            if self._pm_optimizer_state is not None:  # the state saved before a restart
                self.pm_optimizer.load_state_dict(self._pm_optimizer_state)
                self._pm_optimizer_state = None
        decay_lr(self.pm_optimizer, self.cfg.training.lr_decay, ctx.round)  # kept across rounds: this round's rate
        if self.pm_stream is not None:
            self.pm_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.pm_stream):
                stats = train_phase(pm, phase, ctx, data, self.pm_optimizer, should_stop, min_steps, on_step)
            self.pm_stream.synchronize()
        else:
            stats = train_phase(pm, phase, ctx, data, self.pm_optimizer, should_stop, min_steps, on_step)
        self.save_state()
        return stats

    def adapt(
        self, round: int, global_state: Mapping[str, torch.Tensor], knowledge: Any = None, num_epochs: int = 1
    ) -> tuple[float, int]:
        """A new client's adaptation of a global model (:mod:`wafl.common.heterogeneity`); returns the accuracy
        of the adapted model on the local test split and that split's size.

        Each adaptation starts afresh from the received model and the client's initial state. With a
        personal phase (SCD, Ditto, FedRep, FedRoD, FedBABU, pFedMe) the PM starts from the global
        model as in the client's first round and its personal phase trains it (pFedMe, whose local
        round trains its PM theta, runs that local round: ``pm_by_local_round``); otherwise the global
        model itself is fine-tuned (cross-entropy, every parameter, the run's optimizer). Either runs
        ``num_epochs`` epochs over the local training split (0: the model is tested as received)."""
        if self._fresh_local:
            self.gm.load_state_dict(self._fresh_local, strict=False)
        self.client_state.clear()
        self.pm_initialized = False
        self.pm_optimizer = None
        self._pm_optimizer_state = None
        self.begin_round(round, global_state, knowledge, selected=False)
        if self.algorithm.personalized:
            if num_epochs and self.algorithm.pm_by_local_round:
                self.train_gm(float(num_epochs))
            elif num_epochs:
                self.train_pm(None, float(num_epochs))
            return self.evaluate_personal()
        if num_epochs:
            phase = Phase("finetune", main=False)
            data = self._data(phase, float(num_epochs))
            train_phase(self.gm, phase, self._context(), data, self._optimizer(parameters_of(self.gm, phase.params)))
        return self.evaluate_local(self.gm)

    def gm_round(self, base: Mapping[str, torch.Tensor] | None = None, evaluate: bool = False) -> GmRound:
        """A selected client's GM phase in one call (one hop to the thread or process that trains it):
        :meth:`train_gm`, :meth:`knowledge`, with ``evaluate`` the accuracy of the client's own model
        (the PM when the algorithm's local model is personal, the local model when it has no personal
        model, else none), then :meth:`gm_upload_state` of ``base``."""
        stats = self.train_gm()
        knowledge = self.knowledge()
        evaluated: tuple[str, float, int] | None = None
        if evaluate:
            if self.algorithm.local_model_is_personal:
                evaluated = ("pm", *self.evaluate_personal())
            elif self.algorithm.personal == "none":
                evaluated = ("local", *self.evaluate_local(self.gm))
        state = self.gm_upload_state(base)
        bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            r = self._started[0] if self._started is not None else "?"
            raise TrainingDiverged(
                f"client {self.index}, round {r}: local training diverged, {len(bad)} tensor(s) to upload hold NaN "
                f"or Inf (first {bad[0]!r}; the round's mean loss {stats.mean_loss:g}); a smaller lr, or grad_clip, "
                "keeps the steps bounded"
            )
        return GmRound(stats, knowledge, evaluated, state)

    def gm_upload_state(self, base: Mapping[str, torch.Tensor] | None = None) -> OrderedDict[str, torch.Tensor]:
        """The tensors the algorithm shares, on the CPU, or their difference to ``base`` (buffered
        aggregation's delta): the local model's shared tensors, then the extra tensors."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        items = [(k, v) for k, v in self.gm.state_dict().items() if self.algorithm.shares(k)]
        if self.extra_names:
            extras = self.algorithm.hooks.upload(self._context())
            if sorted(extras) != sorted(self.extra_names):
                raise ValueError(f"uploaded extras {sorted(extras)} are not the declared {sorted(self.extra_names)}")
            items += [(extra_name(k), extras[k]) for k in self.extra_names]
        for k, v in items:
            t = v.detach().to("cpu", copy=True)
            out[k] = (t - base[k].to(t.dtype) if base is not None else t).contiguous()
        return out

    def personal_model(self) -> torch.nn.Module:
        """What is evaluated as this client's personal model (the PM, the local model, or a view of it)."""
        model = self.pm if self.pm is not None else self.gm
        return self.algorithm.pm_view(model) if self.algorithm.pm_view is not None else model

    def evaluate_personal(self, received: Mapping[str, torch.Tensor] | None = None) -> tuple[float, int]:
        """The personal model's accuracy on the local test split and that split's size.

        ``received``: a global model whose shared tensors are loaded into the local model first, for an
        algorithm whose PM is evaluated on the received global part (``pm_on_received``, FedRep: the
        global body with the personal head). The round protocol evaluates such a PM right after
        :meth:`begin_round` has loaded the next model, and passes the final model here (no round
        begins with it)."""
        if received is not None:
            if not self.algorithm.pm_on_received:
                raise InvariantError(f"algorithm {self.algorithm.name!r} evaluates its PM on its own model")
            self._load_received(received)
        return self.evaluate_local(self.personal_model())

    def knowledge(self) -> Any:
        if self.algorithm.knowledge is None or self.ctx is None:
            return None
        data = batches(self.data.train, self.train_idx, self.cfg.evaluation.eval_batch_size, False, device=self.device)
        return self.algorithm.knowledge(self.gm, data, self.ctx, self.generator)

    def evaluate_local(self, model: torch.nn.Module) -> tuple[float, int]:
        acc, n, _ = evaluate(model, self.data.test, self.test_idx, self.cfg.evaluation.eval_batch_size, self.device)
        return acc, n

    # -------------------------------------------------------------- device residency
    def offload(self, home: torch.device | str = "cpu") -> None:
        """Moves this client's tensors on the training device to ``home`` (a hosted client between its
        trainings, :class:`~wafl.client.residency.Residency`); :meth:`onload` brings them back."""
        home, device = torch.device(home), self.device

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(home, copy=True) if t.device == device else t

        self._offloaded = relocate(vars(self), move, skip=_not_the_clients)

    def onload(self) -> None:
        """Brings the models (parameters, gradients, buffers) and what :meth:`offload` moved back to the
        training device; tensors that always live on the host stay there."""
        if self._offloaded is None:
            return
        offloaded, device = {id(t) for t in self._offloaded}, self.device  # the list keeps the ids unique

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, copy=True) if id(t) in offloaded else t

        relocate(vars(self), move, lambda t: t.to(device, copy=True), skip=_not_the_clients)
        self._offloaded = None

    def _round_start(self, round: int) -> None:
        """What a round's training starts from besides the global model (random generators, client
        state, local tensors), kept when a round begins and put back when the same round begins again:
        a server resumed from its checkpoint opens again the round it was killed in, and the client
        trains it again from where it first started it, so the resumed run builds the same models."""
        if self._started is not None and self._started[0] == round:
            _, gen, rng, client_state, local = self._started
            self.generator.set_state(torch.frombuffer(bytearray(gen), dtype=torch.uint8))
            self.rng.bit_generator.state = copy.deepcopy(rng)
            self.client_state.clear()
            self.client_state.update(copy.deepcopy(client_state))
            if local:
                self.gm.load_state_dict(local, strict=False)
            return
        gm = self.gm.state_dict()
        self._started = (
            round,
            bytes(self.generator.get_state().numpy()),  # bytes: no relocation moves them to a device
            copy.deepcopy(self.rng.bit_generator.state),
            copy.deepcopy(self.client_state),
            {k: gm[k].detach().clone() for k in self.local_keys},
        )

    # -------------------------------------------------------------- snapshots between rounds
    def snapshot(self) -> dict[str, Any]:
        """What this client's later rounds depend on, taken between two rounds (tensors and plain values):
        the local model (whole where a personal model reads it; else the part that does not travel, as the
        next model it trains on overwrites the rest), the PM, the PM optimizer's state, the algorithm's client
        state and both random generators (batch order, the algorithm's own draws). A trainer built anew for
        the same client and given it by :meth:`restore` trains the next rounds as this one would. Taken while
        the client is idle; the tensors are this trainer's own, so it is written before the client trains again."""
        gm = self.gm.state_dict()
        kept = gm if self.algorithm.personal != "none" else {k: gm[k] for k in self.local_keys}
        opt = self.pm_optimizer.state_dict() if self.pm_optimizer is not None else self._pm_optimizer_state
        return {
            "gm": {k: v.detach().cpu() for k, v in kept.items()},
            "pm": {k: v.detach().cpu() for k, v in self.pm.state_dict().items()}
            if self.pm is not None and self.separate_pm
            else None,
            "pm_initialized": self.pm_initialized,
            "pm_optimizer": _to_cpu(opt) if opt is not None else None,
            "client_state": _to_cpu(self.client_state),
            "rng": json.dumps(self.rng.bit_generator.state),  # PCG64's 128-bit integers, as JSON numbers
            "generator": self.generator.get_state(),
        }

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Takes a :meth:`snapshot` of this client (same configuration and index) back, in place of the state
        this trainer was built with."""
        _, unexpected = self.gm.load_state_dict(snapshot["gm"], strict=False)
        if unexpected:
            raise ValueError(f"client {self.index}'s snapshot has tensors its model lacks: {unexpected}")
        if self.pm is not None and self.separate_pm and snapshot["pm"] is not None:
            self.pm.load_state_dict(snapshot["pm"])
        self.pm_initialized = bool(snapshot["pm_initialized"])
        self.pm_optimizer = None
        self._pm_optimizer_state = snapshot["pm_optimizer"]  # applied on the PM's next training, as after a restart
        self.client_state.clear()
        self.client_state.update(snapshot["client_state"])
        self.rng.bit_generator.state = json.loads(snapshot["rng"])
        self.generator.set_state(snapshot["generator"])
        self._started = None
        self.ctx = None

    # -------------------------------------------------------------- persistence
    def _fingerprint(self) -> str:
        return json.dumps({"config": json.loads(self.cfg.to_json()), "index": self.index}, sort_keys=True)

    def save_state(self) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        gm = self.gm.state_dict()
        payload = {
            "fingerprint": self._fingerprint(),
            "pm": {k: v.cpu() for k, v in self.pm.state_dict().items()}
            if self.pm is not None and self.separate_pm
            else None,
            "pm_initialized": self.pm_initialized,
            "pm_optimizer": _to_cpu(self.pm_optimizer.state_dict()) if self.pm_optimizer is not None else None,
            "client_state": self.client_state,
            "local": {k: gm[k].detach().cpu() for k in self.local_keys},
        }
        save_verified(self.state_path, payload, STATE_MAGIC)

    def _load_state(self) -> None:
        """The state file of an earlier process of this client: verified like the server's
        checkpoint (magic, checksum) and decoded without unpickling (tensors and plain values only);
        a file that fails is refused with its reason, one of another run is ignored."""
        if self.state_path is None:
            return
        payload = load_verified(self.state_path, STATE_MAGIC, "client state")
        if not isinstance(payload, dict) or payload.get("fingerprint") != self._fingerprint():
            return  # none, or state of another run: start fresh
        if self.pm is not None and self.separate_pm and payload.get("pm") is not None:
            self.pm.load_state_dict(payload["pm"])
            self.pm_initialized = bool(payload.get("pm_initialized", True))
        if self.pm is not None and payload.get("pm_optimizer") is not None:
            self._pm_optimizer_state = payload["pm_optimizer"]
        if payload.get("local"):
            self.gm.load_state_dict(payload["local"], strict=False)
        self.client_state.update(payload.get("client_state", {}))


def _not_the_clients(obj: Any) -> bool:
    """What a client's relocation must not touch: the dataset its worker shares, other trainers, CUDA
    streams, random generators."""
    return isinstance(obj, FederatedDataset | Trainer | RunConfig | torch.Generator | np.random.Generator) or (
        type(obj).__name__ == "Stream"
    )


def _to_cpu(obj: Any) -> Any:
    """An optimizer's state dict with every tensor on the CPU (a restart may use another device)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj

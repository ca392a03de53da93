"""A client's models and local data; every method here runs in a worker thread.

It holds the generic model (GM, loaded from each broadcast and uploaded) and, for
personalized algorithms, the personalized model (PM, never uploaded, kept across rounds and
across restarts in ``state_dir``). Training goes through the one shared trainer
(:func:`wafl.common.training.run_phase`) with the algorithm's loss terms.
"""

from __future__ import annotations

import copy
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from wafl.common.algorithms import registry
from wafl.common.algorithms.base import Algorithm, RoundContext
from wafl.common.config import ConfigError, RunConfig
from wafl.common.datasets import FederatedDataset, load_dataset
from wafl.common.models import build_model
from wafl.common.partition import client_shard
from wafl.common.training import PhaseStats, epochs, evaluate, make_optimizer, run_phase


def resolve_device(name: str) -> torch.device:
    if name == "auto":
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
        self.device = resolve_device(device or cfg.device)
        self.algorithm: Algorithm = registry.resolve(cfg.algorithm, cfg.params, vars(cfg))
        self.data = dataset or load_dataset(cfg.dataset, data_dir or cfg.data_dir)
        shard = client_shard(
            self.data.train_labels,
            self.data.test_labels,
            cfg.num_clients,
            cfg.partition,
            cfg.alpha,
            cfg.delta,
            cfg.seed,
            index,
            cfg.local_test_fraction,
        )
        self.train_idx = shard.train
        self.test_idx = shard.test
        counts = np.bincount(self.data.train_labels[self.train_idx], minlength=self.data.num_classes)
        self.label_freq = torch.as_tensor(counts / counts.sum(), dtype=torch.float32, device=self.device)
        torch.manual_seed(cfg.seed)  # every process starts from the same initial weights
        self.gm = build_model(
            cfg.model, self.data.num_classes, self.data.in_channels, self.data.image_size, cfg.code_len
        ).to(self.device)
        self.pm = copy.deepcopy(self.gm) if self.algorithm.personalized else None
        self.pm_initialized = False
        self.client_state: dict[str, Any] = {}
        self.rng = np.random.default_rng([cfg.seed, 6, index])
        self.generator = torch.Generator().manual_seed(cfg.seed * 1000 + index)
        self.state_path = (state_dir / f"client-{index}.pt") if state_dir is not None else None
        self.ctx: RoundContext | None = None
        self.pm_optimizer: torch.optim.Optimizer | None = None  # kept across rounds: the PM's training never restarts
        self.pm_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._load_state()

    @property
    def num_samples(self) -> int:
        return int(len(self.train_idx))

    # -------------------------------------------------------------- rounds
    def begin_round(self, round: int, global_state: Mapping[str, torch.Tensor], knowledge: Any = None) -> RoundContext:
        state = {k: v.to(self.device) for k, v in global_state.items()}
        self.gm.load_state_dict(state)
        if self.pm is not None and not self.pm_initialized:
            self.pm.load_state_dict(state)  # the PM starts equal to the first global model
            self.pm_initialized = True
        self.ctx = RoundContext(round, state, self.gm, self.pm, self.label_freq, self.client_state, knowledge)
        return self.ctx

    def _optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        c = self.cfg
        return make_optimizer(c.optimizer, model.parameters(), c.lr, c.momentum, c.weight_decay)

    def train_gm(self) -> PhaseStats:
        assert self.ctx is not None
        data = epochs(
            self.data.train, self.train_idx, self.cfg.batch_size, self.rng, self.cfg.local_epochs, self.device
        )
        stats = run_phase(self.gm, self.algorithm.gm_terms, self.ctx, data, self._optimizer(self.gm))
        if self.client_state:
            self.save_state()  # client state the GM phase updated (FedDyn's g_k)
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
        assert self.ctx is not None and self.pm is not None and self.algorithm.pm_terms is not None
        data = epochs(self.data.train, self.train_idx, self.cfg.batch_size, self.rng, num_epochs, self.device)
        if self.pm_optimizer is None:
            self.pm_optimizer = self._optimizer(self.pm)
        if self.pm_stream is not None:
            self.pm_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.pm_stream):
                stats = run_phase(
                    self.pm, self.algorithm.pm_terms, self.ctx, data, self.pm_optimizer, should_stop, min_steps, on_step
                )
            self.pm_stream.synchronize()
        else:
            stats = run_phase(
                self.pm, self.algorithm.pm_terms, self.ctx, data, self.pm_optimizer, should_stop, min_steps, on_step
            )
        self.save_state()
        return stats

    def gm_upload_state(self, base: Mapping[str, torch.Tensor] | None = None) -> OrderedDict[str, torch.Tensor]:
        """The GM's tensors on the CPU, or their difference to ``base`` (buffered aggregation's delta)."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for k, v in self.gm.state_dict().items():
            t = v.detach().to("cpu", copy=True)
            out[k] = (t - base[k].to(t.dtype) if base is not None else t).contiguous()
        return out

    def knowledge(self) -> Any:
        if self.algorithm.knowledge is None or self.ctx is None:
            return None
        from wafl.common.training import batches

        data = batches(self.data.train, self.train_idx, self.cfg.eval_batch_size, False, device=self.device)
        return self.algorithm.knowledge(self.gm, data, self.ctx, self.generator)

    def evaluate_local(self, model: torch.nn.Module) -> tuple[float, int]:
        acc, n, _ = evaluate(model, self.data.test, self.test_idx, self.cfg.eval_batch_size, self.device)
        return acc, n

    # -------------------------------------------------------------- persistence
    def _fingerprint(self) -> str:
        return json.dumps({"config": json.loads(self.cfg.to_json()), "index": self.index}, sort_keys=True)

    def save_state(self) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "fingerprint": self._fingerprint(),
            "pm": None if self.pm is None else {k: v.cpu() for k, v in self.pm.state_dict().items()},
            "pm_initialized": self.pm_initialized,
            "client_state": self.client_state,
        }
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, self.state_path)

    def _load_state(self) -> None:
        if self.state_path is None or not self.state_path.exists():
            return
        payload = torch.load(self.state_path, map_location="cpu", weights_only=False)
        if payload.get("fingerprint") != self._fingerprint():
            return  # state of another run: start fresh
        if self.pm is not None and payload.get("pm") is not None:
            self.pm.load_state_dict(payload["pm"])
            self.pm_initialized = bool(payload.get("pm_initialized", True))
        self.client_state.update(payload.get("client_state", {}))

"""Helpers for the round-policy tests: a strategy of a 3-client run with no transport, and uploads
folded into it chunk by chunk as the engine folds them."""

from __future__ import annotations

import torch
from wafl.common.algorithms import registry
from wafl.common.codec import iter_chunks, manifest_of
from wafl.common.config import load_config
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.strategies import make_strategy

IDS = ["a", "b", "c"]
SAMPLES = {"a": 10, "b": 30, "c": 20}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 4, generator=g), "b": torch.randn(4, generator=g)}


def make(**overrides):
    cfg = load_config(None, {"num_clients": 3, **overrides})
    manifest = manifest_of(state(0))
    algo = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
    s = make_strategy(cfg, algo, 10, lambda: Accumulator(manifest))
    for i, cid in enumerate(IDS):
        s.join(cid, i, SAMPLES[cid])
    return s


def upload(s, cid: str, round: int, tensors, key: str = "", now: float = 0.0, metrics=None):
    metrics = {"train_loss": 1.0, **(metrics or {})}
    t = s.open(cid, round, SAMPLES[cid], key or f"{cid}-{round}", now, metrics)
    fold = t.collection.accumulator.begin(t.weight)
    specs = {sp.name: sp for sp in t.collection.accumulator.manifest}
    for c in iter_chunks(tensors.items(), 16):
        fold.add(specs[c.name], c)
    fold.commit()
    return t, s.commit(t, metrics, None, 100, now)

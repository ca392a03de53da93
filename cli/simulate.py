"""The same federation in one process, for learning checks: no sockets, same algorithm code.

Clients are the real :class:`~wafl.client.trainer.Trainer`; uploads go chunk by chunk through
the server's :class:`~wafl.server.aggregator.Accumulator` and the algorithm's server update;
knowledge through the same accumulator the server uses. Selection is the server's. The PM
trains ``pm_epochs`` per round (what compute-and-wait does; wait-free trains it for as long as
the round lasts, which depends on the machine, not on the algorithm).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from wafl.client.trainer import Trainer
from wafl.common.algorithms import registry
from wafl.common.algorithms.hyperknowledge import Knowledge, KnowledgeAccumulator
from wafl.common.codec import iter_chunks, manifest_of
from wafl.common.config import RunConfig
from wafl.common.datasets import load_dataset
from wafl.common.training import evaluate
from wafl.server.aggregator import Accumulator
from wafl.server.selection import select_clients


def simulate(cfg: RunConfig, on_round: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Runs ``cfg`` in-process; returns one row per round (``gm_accuracy``, ``pm_accuracy``, ...)."""
    t0 = time.monotonic()
    data = load_dataset(cfg.dataset, cfg.data_dir)
    trainers = [Trainer(cfg, i, dataset=data, device="cpu") for i in range(cfg.num_clients)]
    server = registry.resolve(cfg.algorithm, cfg.params, vars(cfg)).server
    global_state = OrderedDict((k, v.detach().clone()) for k, v in trainers[0].gm.state_dict().items())
    manifest = manifest_of(global_state)
    specs = {s.name: s for s in manifest}
    knowledge: Knowledge = {}
    ids = [f"client-{i}" for i in range(cfg.num_clients)]
    algo = trainers[0].algorithm
    test_idx = np.arange(len(data.test_labels))
    rows: list[dict[str, Any]] = []
    for r in range(1, cfg.rounds + 1):
        selected = sorted(select_clients(cfg.seed, r, ids, cfg.fraction, cfg.act_prob), key=ids.index)
        acc = Accumulator(manifest)
        kacc = KnowledgeAccumulator(data.num_classes) if algo.knowledge is not None else None
        pm_scores: list[tuple[float, int]] = []
        for cid in selected:
            t = trainers[ids.index(cid)]
            t.begin_round(r, global_state, knowledge)
            t.train_gm()
            if kacc is not None:
                k = t.knowledge()
                if k:
                    kacc.add(k)
            if algo.local_model_is_personal:
                pm_scores.append(t.evaluate_local(t.gm))
            fold = acc.begin(server.weight(t.num_samples))
            for chunk in iter_chunks(t.gm_upload_state().items()):
                fold.add(specs[chunk.name], chunk)
            fold.commit()
            if algo.personalized and cfg.pm_epochs > 0:
                t.train_pm(None, float(cfg.pm_epochs))
                pm_scores.append(t.evaluate_local(t.pm))
        new = server.finalize(global_state, acc.mean(), acc.count)
        global_state = OrderedDict((k, new[k].detach().to(v.dtype).contiguous()) for k, v in global_state.items())
        if kacc is not None:
            knowledge = kacc.result()
        model = trainers[0].gm
        saved = OrderedDict((k, v.clone()) for k, v in model.state_dict().items())
        model.load_state_dict(global_state)
        gm_acc, _, gm_loss = evaluate(model, data.test, test_idx, cfg.eval_batch_size)
        model.load_state_dict(saved)
        n = sum(k for _, k in pm_scores)
        row = {
            "round": r,
            "gm_accuracy": gm_acc,
            "gm_loss": gm_loss,
            "pm_accuracy": (sum(a * k for a, k in pm_scores) / n) if n else None,
            "clients": len(selected),
            "wall_s": time.monotonic() - t0,
        }
        rows.append(row)
        if on_round is not None:
            on_round(row)
    return rows


def run_many(configs: dict[str, RunConfig], seeds: list[int], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs every configuration for every seed; returns per-run rows and mean/std of final accuracies."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, cfg in configs.items():
        finals = []
        for seed in seeds:
            c = RunConfig.from_json(cfg.to_json())
            c.seed = seed
            c.validate()
            rows = simulate(c)
            f = rows[-1]
            finals.append(
                {
                    "seed": seed,
                    "gm_accuracy": f["gm_accuracy"],
                    "pm_accuracy": f["pm_accuracy"],
                    "wall_s": f["wall_s"],
                    "curve": [(x["gm_accuracy"], x["pm_accuracy"]) for x in rows],
                }
            )
            pm = "-" if f["pm_accuracy"] is None else f"{f['pm_accuracy']:.4f}"
            log(f"{name:<28} seed {seed}: gm {f['gm_accuracy']:.4f} pm {pm} ({f['wall_s']:.0f}s)")
        out[name] = {"config": cfg.to_json(), "runs": finals, **summarize(finals)}
    return out


def summarize(finals: list[dict[str, Any]]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for key in ("gm_accuracy", "pm_accuracy"):
        vals = [f[key] for f in finals if f[key] is not None]
        if vals:
            res[key] = {
                "mean": float(np.mean(vals)),
                "std": float(np.std(vals)),
                "min": float(np.min(vals)),
                "max": float(np.max(vals)),
            }
    return res

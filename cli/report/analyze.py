"""``wafl analyze flatness``: the curvature of a run's global model on its clients' training data.

A run folder (``config.json``, ``results.jsonl`` and ``checkpoint.pt``, as ``wafl run``,
``wafl sweep`` and the in-process runs write them with ``checkpoint = true``) holds the global
model of its last finished round in ``checkpoint.pt``, and with ``keep_checkpoint_every = N`` that of
every N-th round in ``checkpoints/round-R.pt`` (``--round R``); ``--checkpoint FILE`` takes any other
checkpoint file of the run. The model is rebuilt from the configuration in the checkpoint,
and the loss is the mean cross-entropy over the union of the clients' training shards, rebuilt
from the seed as the clients built them (over what a public split leaves), or over a fixed
sample of ``--samples`` of them drawn from ``--sample-seed``. The sample is drawn (and, where the
dataset augments its training images, augmented) once, so every Hessian-vector product is of
one function. Reported (:mod:`wafl.common.analysis.hessian`): the top eigenvalue by power
iteration, the trace by Hutchinson's estimator with its standard error, and with ``--density``
the eigenvalue density by stochastic Lanczos quadrature as a PNG.

Given several run folders (or folders holding them, such as a sweep's), each is measured and the
runs are grouped into rows as ``wafl table`` groups them (algorithm and parameters by default),
each cell the mean +- standard deviation over the row's seeds with the min-max spread.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wafl.cli.report.table import _stats, label
from wafl.common.errors import UsageError

if TYPE_CHECKING:
    import numpy as np
    from torch import nn
    from wafl.common.config import RunConfig
    from wafl.common.datasets import FederatedDataset

CHECKPOINT = "checkpoint.pt"


@dataclass
class RunModel:
    """A run's global model as one of its checkpoints holds it, with the data it was trained on."""

    config: RunConfig
    round: int
    checkpoint: Path
    model: nn.Module
    dataset: FederatedDataset
    train_idx: np.ndarray  # the union of every client's training shard


def training_union(cfg: RunConfig, dataset: FederatedDataset) -> np.ndarray:
    """Every training client's training indices together (sorted), rebuilt from the seed as the clients
    build their shards: the partition of what the algorithm's public split leaves (the shards of the
    ``new_clients``, which never train, left out)."""
    import numpy as np
    from wafl.common.algorithms import registry
    from wafl.common.heterogeneity import new_client_indices
    from wafl.common.partition import run_shards

    public_size = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict()).public_size
    shards = run_shards(cfg, dataset.train_labels, public_size)
    new = new_client_indices(cfg.federation.num_clients, cfg.federation.new_clients, cfg.federation.seed)
    return np.sort(np.concatenate([s for i, s in enumerate(shards) if i not in new]))


def load_run_model(run_dir: Path, checkpoint: Path | None = None, data_dir: str | None = None) -> RunModel:
    """The global model of ``run_dir``'s checkpoint (default: its ``checkpoint.pt``, the last round's)."""
    from wafl.common.algorithms import registry
    from wafl.common.algorithms.base import split_payload
    from wafl.common.config import ConfigError, RunConfig
    from wafl.common.datasets import load_dataset
    from wafl.common.models import build_model
    from wafl.server.checkpoint import load_checkpoint

    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a folder")
    path = checkpoint or run_dir / CHECKPOINT
    ck = load_checkpoint(path)
    if ck is None:
        how = (
            " (rounds are kept with keep_checkpoint_every = N)"
            if checkpoint
            else " (the run was made with checkpoint = false: run it again with checkpoint = true)"
        )
        raise UsageError(f"{path}: no checkpoint there{how}")
    try:
        cfg = RunConfig.from_mapping(ck["config"])
        if data_dir is not None:
            cfg.data.data_dir = data_dir
        cfg.validate()
    except ConfigError as e:
        raise UsageError(f"{path}: its configuration is not valid here: {e}") from None
    algorithm = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
    if not algorithm.evaluates_global:
        raise UsageError(f"{path}: {cfg.training.algorithm}'s shared tensors make no global model to analyse")
    dataset = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    model = algorithm.build(
        build_model(
            cfg.training.model, dataset.num_classes, dataset.in_channels, dataset.image_size, cfg.training.code_len
        )
    )
    _, unexpected = model.load_state_dict(split_payload(ck["global_state"])[0], strict=False)
    if unexpected:
        raise UsageError(f"{path}: tensors {unexpected[:3]} are not in a {cfg.training.model} model")
    return RunModel(cfg, int(ck["round"]), path, model, dataset, training_union(cfg, dataset))


def sample_indices(indices: np.ndarray, samples: int | None, seed: int) -> np.ndarray:
    """``samples`` of ``indices`` drawn without replacement from ``seed`` (sorted); all of them for None."""
    import numpy as np

    if samples is None or samples >= len(indices):
        return np.asarray(indices)
    return np.sort(np.random.default_rng([seed, 29]).choice(indices, size=samples, replace=False))


def flatness(
    run_dir: Path,
    checkpoint: Path | None = None,
    samples: int | None = None,
    sample_seed: int = 0,
    probes: int = 100,
    max_iter: int = 100,
    tol: float = 1e-3,
    density: Path | None = None,
    lanczos_steps: int = 90,
    lanczos_runs: int = 1,
    batch_size: int = 256,
    device: str = "cpu",
    data_dir: str | None = None,
) -> dict[str, Any]:
    """The flatness measures of a run's global model (module docstring), as a JSON-ready dict."""
    import torch
    from wafl.client.trainer import resolve_device
    from wafl.common.analysis import hessian as H
    from wafl.common.training import batches

    t0 = time.monotonic()
    run = load_run_model(run_dir, checkpoint, data_dir)
    dev = resolve_device(device)
    model = run.model.to(dev)
    idx = sample_indices(run.train_idx, samples, sample_seed)
    torch.manual_seed(sample_seed)  # the one augmented view of each image, where the dataset augments
    data = list(batches(run.dataset.train, idx, batch_size, False, device=dev))
    op = H.HessianOperator(model, data)
    eig = H.top_eigenvalue(op, max_iter=max_iter, tol=tol, seed=sample_seed)
    trace = H.hutchinson_trace(op, probes=probes, seed=sample_seed + 1)
    cfg = run.config
    out: dict[str, Any] = {
        "run_dir": str(run_dir),
        "checkpoint": str(run.checkpoint),
        "round": run.round,
        "algorithm": cfg.training.algorithm,
        "params": cfg.training.params,
        "seed": cfg.federation.seed,
        "dataset": cfg.data.dataset,
        "model": cfg.training.model,
        "samples": int(len(idx)),
        "training_samples": int(len(run.train_idx)),
        "sample_seed": sample_seed,
        "parameters": op.dim,
        "loss": op.value(),
        "top_eigenvalue": {"value": eig.value, "iterations": eig.iterations, "converged": eig.converged, "tol": tol},
        "trace": {"mean": trace.mean, "stderr": trace.stderr, "probes": trace.probes},
    }
    if density is not None:
        d = H.lanczos_density(op, steps=lanczos_steps, runs=lanczos_runs, seed=sample_seed + 2)
        H.plot_density(
            d, str(density), title=f"{cfg.training.algorithm}, round {run.round}: Hessian eigenvalue density"
        )
        out["density"] = {
            "png": str(density),
            "steps": int(d.nodes.shape[1]),
            "runs": lanczos_runs,
            "sigma": d.sigma,
            "min_node": float(d.nodes.min()),
            "max_node": float(d.nodes.max()),
            "mean": d.mean(),
        }
    out["hvp_products"] = op.products
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def run_folders(paths: list[Path]) -> list[Path]:
    """The run folders at or below ``paths``: those with a ``config.json`` and a checkpoint."""
    found: list[Path] = []
    for p in paths:
        if (p / CHECKPOINT).exists():
            found.append(p)
        elif p.is_dir():
            found += sorted(c.parent for c in p.rglob(CHECKPOINT) if (c.parent / "config.json").exists())
        else:
            raise UsageError(f"{p} is not a folder")
    if not found:
        raise UsageError(f"no run folder with a {CHECKPOINT} under {', '.join(map(str, paths))}")
    return found


def table(results: list[dict[str, Any]], by: tuple[str, ...]) -> dict[str, Any]:
    """Rows as ``wafl table`` makes them: label -> seeds, runs, and the stats of each measure."""
    rows: dict[str, dict[str, Any]] = {}
    for r in results:
        config = json.loads((Path(r["run_dir"]) / "config.json").read_text())
        row = rows.setdefault(label(config, by), {"seeds": [], "runs": [], "top": [], "trace": []})
        row["seeds"].append(r["seed"])
        row["runs"].append(r["run_dir"])
        row["top"].append(r["top_eigenvalue"]["value"])
        row["trace"].append(r["trace"]["mean"])
    return {
        name: {
            "seeds": row["seeds"],
            "runs": row["runs"],
            "top_eigenvalue": _stats(row["top"]),
            "trace": _stats(row["trace"]),
        }
        for name, row in rows.items()
    }


def markdown(rows: dict[str, Any]) -> str:
    def cell(s: dict[str, float]) -> str:
        return f"{s['mean']:.3g} ± {s['std']:.2g} ({s['min']:.3g}–{s['max']:.3g})"

    lines = ["| run | seeds | top eigenvalue | trace |", "|---|---:|---:|---:|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {len(r['seeds'])} | {cell(r['top_eigenvalue'])} | {cell(r['trace'])} |")
    return "\n".join(lines)

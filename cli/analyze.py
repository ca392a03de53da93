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

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

    public_size = registry.resolve(cfg.algorithm, cfg.params, vars(cfg)).public_size
    shards = run_shards(cfg, dataset.train_labels, public_size)
    new = new_client_indices(cfg.num_clients, cfg.new_clients, cfg.seed)
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
            cfg.data_dir = data_dir
        cfg.validate()
    except ConfigError as e:
        raise UsageError(f"{path}: its configuration is not valid here: {e}") from None
    algorithm = registry.resolve(cfg.algorithm, cfg.params, vars(cfg))
    if not algorithm.evaluates_global:
        raise UsageError(f"{path}: {cfg.algorithm}'s shared tensors make no global model to analyse")
    dataset = load_dataset(cfg.dataset, cfg.data_dir)
    model = algorithm.build(
        build_model(cfg.model, dataset.num_classes, dataset.in_channels, dataset.image_size, cfg.code_len)
    )
    _, unexpected = model.load_state_dict(split_payload(ck["global_state"])[0], strict=False)
    if unexpected:
        raise UsageError(f"{path}: tensors {unexpected[:3]} are not in a {cfg.model} model")
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
        "algorithm": cfg.algorithm,
        "params": cfg.params,
        "seed": cfg.seed,
        "dataset": cfg.dataset,
        "model": cfg.model,
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
        H.plot_density(d, str(density), title=f"{cfg.algorithm}, round {run.round}: Hessian eigenvalue density")
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
    from wafl.cli.table import _stats, label

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


def cmd_flatness(a: argparse.Namespace) -> int:
    folders = run_folders([Path(p) for p in a.dirs])
    if a.density and len(folders) > 1:
        raise UsageError(f"--density draws one run's density; {len(folders)} run folders were given")
    if a.checkpoint and len(folders) > 1:
        raise UsageError(f"--checkpoint names one run's checkpoint; {len(folders)} run folders were given")
    if a.checkpoint and a.round:
        raise UsageError("--checkpoint and --round both name a checkpoint: give one")
    if a.threads:
        from wafl.cli.commands.process import set_threads

        set_threads(a.threads)
    results = []
    for f in folders:
        chosen = Path(a.checkpoint) if a.checkpoint else None
        if a.round:
            chosen = f / "checkpoints" / f"round-{a.round}.pt"
        r = flatness(
            f,
            checkpoint=chosen,
            samples=a.samples,
            sample_seed=a.sample_seed,
            probes=a.probes,
            max_iter=a.max_iter,
            tol=a.tol,
            density=Path(a.density) if a.density else None,
            lanczos_steps=a.lanczos_steps,
            lanczos_runs=a.lanczos_runs,
            batch_size=a.batch_size,
            device=a.device,
            data_dir=a.data_dir,
        )
        results.append(r)
        top, tr = r["top_eigenvalue"], r["trace"]
        print(
            f"{f}: round {r['round']}, {r['samples']} samples, loss {r['loss']:.4f}: top eigenvalue "
            f"{top['value']:.4g} ({top['iterations']} iterations{'' if top['converged'] else ', not converged'}), "
            f"trace {tr['mean']:.4g} ± {tr['stderr']:.2g} ({tr['probes']} probes)"
            + (f", density in {r['density']['png']}" if "density" in r else "")
        )
    doc: dict[str, Any] = results[0] if len(folders) == 1 and not a.table else {"runs": results}
    if "runs" in doc:
        from wafl.cli.provenance import git_commit

        by = tuple(f.strip() for f in a.by.split(",")) if a.by else ("algorithm", "params")
        doc["by"] = list(by)
        doc["rows"] = table(results, by)
        doc["commit"] = git_commit()
        print(markdown(doc["rows"]))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def add_parser(sub: Any, positive_int: Any, positive: Any) -> None:
    """Registers ``wafl analyze`` and its commands (``flatness``, ``curves``) on the ``wafl`` sub-parsers."""
    an = sub.add_parser("analyze", help="measurements of finished runs' models")
    asub = an.add_subparsers(dest="analysis", required=True)
    f = asub.add_parser(
        "flatness",
        help="top Hessian eigenvalue, Hessian trace (and eigenvalue density) of a run's global model",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    f.add_argument("dirs", nargs="+", metavar="RUN_DIR", help="run folders, or folders holding them (a sweep's)")
    f.add_argument("--checkpoint", help="a checkpoint file of the run (default: RUN_DIR/checkpoint.pt, the last round)")
    f.add_argument(
        "--round",
        type=positive_int,
        help="the checkpoint of this round, RUN_DIR/checkpoints/round-R.pt (kept with keep_checkpoint_every)",
    )
    f.add_argument("--samples", type=positive_int, help="a seeded sample of this many training points (default: all)")
    f.add_argument("--sample-seed", dest="sample_seed", type=int, default=0, help="seed of the sample and probes")
    f.add_argument("--probes", type=positive_int, default=100, help="Rademacher probes of the trace (default 100)")
    f.add_argument("--max-iter", dest="max_iter", type=positive_int, default=100, help="power iterations at most")
    f.add_argument("--tol", type=positive, default=1e-3, help="relative change that ends the power iteration")
    f.add_argument("--density", metavar="PNG", help="also draw the eigenvalue density (Lanczos quadrature) here")
    f.add_argument("--lanczos-steps", dest="lanczos_steps", type=positive_int, default=90)
    f.add_argument("--lanczos-runs", dest="lanczos_runs", type=positive_int, default=1)
    f.add_argument("--batch-size", dest="batch_size", type=positive_int, default=256)
    f.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    f.add_argument(
        "--threads",
        type=positive_int,
        help="torch threads on the CPU (default: torch's, one a core; 1 is faster beside other work)",
    )
    f.add_argument("--data-dir", dest="data_dir", help="where the run's dataset is on this machine")
    f.add_argument("--by", help="with several runs: fields that make the rows (default: algorithm,params)")
    f.add_argument("--table", action="store_true", help="a table even for one run")
    f.add_argument("--json", help="write the measurements (and table) as JSON here")
    f.set_defaults(fn=cmd_flatness)
    from wafl.cli.curves import add_parser as add_curves

    add_curves(asub)

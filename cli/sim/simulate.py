"""The same federation in one process, for learning checks: no sockets, the same code as ``wafl run``.

:func:`simulate` runs the real :class:`~wafl.server.engine.RoundEngine` with its strategy, the
real client :class:`~wafl.client.protocol.RoundProtocol` and :class:`~wafl.client.trainer.Trainer`
of every client, connected by the in-process transport (:class:`~wafl.cli.sim.local_transport.LocalSession`)
in one event loop. Training runs in worker threads as in a client process; with one torch thread
(:func:`run_many` sets it) a seeded run builds the same global models as over gRPC. With
:class:`~wafl.cli.sim.resume.Snapshots` a run takes snapshots between versions and resumes from the one its
folder holds (:mod:`wafl.cli.sim.resume`).
"""

from __future__ import annotations

import asyncio
import copy
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from wafl.cli.sim.local_transport import LocalSession
from wafl.cli.sim.resume import Snapshots
from wafl.client.hosting import ProcessSlots, SharedReception, SharedSlots, Trainer, client_protocol, warm_up_torch
from wafl.common.algorithms.base import split_payload
from wafl.common.analysis.dissimilarity import full_gradient, gradient_dissimilarity
from wafl.common.config import RunConfig
from wafl.server.engine import RoundEngine
from wafl.server.strategies import check_aggregation


def simulate(
    cfg: RunConfig,
    out_dir: Path | None = None,
    pool: Callable[[], SharedSlots] | None = None,
    slot_processes: int = 0,
    snapshots: Snapshots | None = None,
) -> list[dict[str, Any]]:
    """Runs ``cfg`` in-process; returns its ``results.jsonl`` rows (``gm_accuracy``, ``pm_accuracy``, ...).

    The run's folder is ``out_dir`` (a temporary one, deleted afterwards, when None: then the run
    writes no checkpoint, which nothing could resume from). ``pool`` makes
    the clients share one pool of training slots, as the clients of a ``wafl worker`` do;
    ``slot_processes`` > 0 instead trains them in that many forked processes
    (:class:`~wafl.client.process_slots.ProcessSlots`, compute-and-wait only), the protocol, the
    transport and the server staying in this one. ``snapshots`` (of ``out_dir``): the run resumes from the
    snapshot found there, if any, and takes snapshots as it goes (:mod:`wafl.cli.sim.resume`); the rows
    returned are then every line of ``results.jsonl``, the earlier sittings' included. ``cfg`` is validated
    (``RunConfig.validate``); its aggregation rule is checked here (:func:`~wafl.server.strategies.check_aggregation`).
    """
    check_aggregation(cfg)
    if slot_processes and (pool is not None or not trains_in_processes(cfg)):
        raise ValueError(
            f"slot_processes={slot_processes} needs protocol='compute-and-wait' (not {str(cfg.client.protocol)!r}), "
            "no new clients and no pool"
        )
    if snapshots is not None and (out_dir is None or snapshots.out_dir != out_dir):
        raise ValueError("snapshots are those of the run's folder, out_dir")
    if out_dir is not None:
        return asyncio.run(_simulate(cfg, out_dir, pool, slot_processes, snapshots))
    # a checkpoint a round (2.8 ms of the 10 ms between two rounds of 10 digits clients, with both
    # training processes idle) into a folder deleted at the end
    unkept = copy.deepcopy(cfg)
    unkept.output.checkpoint, unkept.output.keep_checkpoint_every = False, 0
    with tempfile.TemporaryDirectory(prefix="wafl-sim-") as tmp:
        return asyncio.run(_simulate(unkept, Path(tmp), pool, slot_processes))


def trains_in_processes(cfg: RunConfig) -> bool:
    """Whether ``cfg``'s clients can train in slot processes: compute-and-wait (a wait-free PM asks
    the event loop when to stop), and no new clients (their adaptation is not a trainer's method)."""
    return cfg.client.protocol == "compute-and-wait" and not cfg.federation.new_clients


async def _simulate(
    cfg: RunConfig,
    out_dir: Path,
    pool: Callable[[], SharedSlots] | None = None,
    slot_processes: int = 0,
    snapshots: Snapshots | None = None,
) -> list[dict[str, Any]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    warm_up_torch()  # as a client process does while it joins: not inside the first training phase
    found = snapshots.found if snapshots is not None else None
    if found is not None:
        found.cut_back()
    engine = RoundEngine(cfg, out_dir, resume=found is not None)
    if found is not None:
        found.restore_engine(engine)
    reception = SharedReception()  # a broadcast the clients receive alike: one buffer, one decode (as in a worker)
    trainers, sessions = [], []
    for i in range(cfg.federation.num_clients):
        trainer = Trainer(cfg, i, dataset=engine.dataset, device="cpu")
        if found is not None:
            trainer.restore(found.trainer_state(i))
        session = LocalSession(engine, f"client-{i}", i, trainer.num_samples, reception)
        session.join(returning=found is not None)
        trainers.append(trainer)
        sessions.append(session)
    # made in this event loop, which counts its slots; the processes fork once every trainer is built
    shared = ProcessSlots(slot_processes, trainers) if slot_processes else pool() if pool is not None else None
    clients = [client_protocol(s, t, shared.view(t) if shared else None) for s, t in zip(sessions, trainers)]
    if snapshots is not None:
        if found is not None:
            for c in clients:
                found.restore_protocol(c)
            snapshots.found = None  # taken back: its tensors can go
        engine.rounds.between_versions = snapshots.pause(engine, clients)
    if cfg.evaluation.grad_dissimilarity_every:
        engine.rounds.round_probe = dissimilarity_probe(cfg, engine, {c.session.client_id: c.trainer for c in clients})
    tasks = [asyncio.create_task(_client_run(c.run(), c.session.client_id)) for c in clients]
    try:
        # a client that fails ends the simulation with its error at once: the server would otherwise
        # wait for its upload until the round deadline (far off in a sweep), with nothing on the cores
        await asyncio.gather(engine.run_to_end(), *tasks)
    finally:
        for t in tasks:
            t.cancel()
        engine.executor.shutdown(wait=False, cancel_futures=True)
        engine.fold_workers.shutdown()  # its threads end (a sweep process runs point after point)
        if shared is not None:
            shared.shutdown()
    return engine.results.rows


async def _client_run(run: Awaitable[None], client_id: str) -> None:
    try:
        await run
    except Exception as e:
        e.add_note(f"in the simulation's client {client_id}")
        raise


def dissimilarity_probe(
    cfg: RunConfig, engine: RoundEngine, trainers: Mapping[str, Trainer]
) -> Callable[[int, Mapping[str, torch.Tensor], list[str]], dict[str, Any]]:
    """The engine's round probe of ``grad_dissimilarity_every``: every N rounds, ``G_d`` of the selected
    clients' full training-loss gradients at the global model they were sent
    (:mod:`wafl.common.analysis.dissimilarity`), computed on a copy of the model."""
    model = copy.deepcopy(engine.model)

    def probe(round: int, state: Mapping[str, torch.Tensor], selected: list[str]) -> dict[str, Any]:
        if round % cfg.evaluation.grad_dissimilarity_every or not selected:
            return {}
        model.load_state_dict(split_payload(state)[0], strict=False)
        grads = [
            full_gradient(model, engine.dataset.train, trainers[c].train_idx, cfg.evaluation.eval_batch_size)
            for c in selected
        ]
        return gradient_dissimilarity(grads)

    return probe


def run_many(configs: dict[str, RunConfig], seeds: list[int], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs every configuration for every seed; returns per-run rows and mean/std of final accuracies."""
    from wafl.common.logs import configure_logging

    configure_logging("simulate", level="WARNING")  # the engine's and clients' per-round lines stay quiet
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name, cfg in configs.items():
        finals = []
        for seed in seeds:
            c = RunConfig.from_json(cfg.to_json())
            c.federation.seed = seed
            c.validate()
            rows = simulate(c)
            f = rows[-1]
            finals.append(
                {
                    "seed": seed,
                    "gm_accuracy": f["gm_accuracy"],
                    "pm_accuracy": f["pm_accuracy"],
                    "local_accuracy": f.get("local_accuracy"),
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
    for key in ("gm_accuracy", "pm_accuracy", "local_accuracy"):
        vals = [f[key] for f in finals if f[key] is not None]
        if vals:
            res[key] = {
                "mean": float(np.mean(vals)),
                "std": float(np.std(vals)),
                "min": float(np.min(vals)),
                "max": float(np.max(vals)),
            }
    return res

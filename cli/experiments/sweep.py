"""``wafl sweep FILE.toml``: one federation per point of a grid (or list), each in its own run folder.

The file::

    out = "runs/sweep-asd"          # optional (default: runs/sweep-<file name>)
    [base]                          # configuration fields every point shares
    num_clients = 10
    rounds = 15
    [grid]                          # the points are the product of these lists
    algorithm = ["fedavg", "fedavg+asd"]
    "params.asd_lambda" = [2.0]     # an algorithm parameter
    seed = [0, 1, 2]
    [[points]]                      # or/and: explicit points (overrides of base)
    algorithm = "feddyn"

Fields are named flat (``lr``), as a section's table (``[base.training]`` then ``lr = 0.1``) or as
``"training.lr"`` (:func:`~wafl.common.config.flat_fields`); a point's folder is named by the keys as written.

``[params_for.<algorithm>]`` gives algorithm parameters to every point whose algorithm has that base
(``[params_for.fedspeed]`` then ``dual_mean = "all"`` reaches ``fedspeed`` and ``fedspeed+asd``), over
``[base]``'s ``params`` and under a point's own; they are not part of the points' folder names.

A file may start from another: ``extends = "scd_fmnist.toml"`` takes that sweep's ``base``, ``grid`` and
``points``, with this file's ``base`` fields (and ``params_for`` parameters) over them and its ``grid`` lists
and ``points`` (if any) in their place (the same comparison run longer, for example).

A point's folder is named by the values that vary (``algorithm=fedavg,seed=0``) and is a normal
run folder (``config.json``, ``results.jsonl``, ...). Points run in process (the same engine and
client code as ``wafl run``, one thread each) or, with ``--network``, as a server and client
processes over localhost; ``--jobs`` runs several at once. A finished point leaves ``point.json``
and is skipped when the sweep runs again, so an interrupted sweep resumes where it stopped.

A point interrupted part-way (the sweep killed, the machine gone) resumes from its last completed snapshot
when the sweep runs again, in process: the point pauses between two rounds now and then and writes its
server's and every client's state into its folder's ``resume/`` (:mod:`wafl.cli.sim.resume`; every
``--snapshot-every N`` rounds, by default as often as keeps their cost under 2 % of the point's time). The
resumed point writes the same ``results.jsonl`` lines as an uninterrupted one (timing fields aside), stops on
the plateau at the same round, and its ``point.json`` has the same fields, its ``wall_s`` the sum over the
sittings (each as far as its last completed round); ``resume/`` is removed once ``point.json`` is written.
Which points can resume exactly: sync aggregation, no new clients, and compute-and-wait or an algorithm
without a personal phase (:func:`~wafl.cli.sim.resume.not_resumable`). Any other point, a ``--network``
point, and a point whose snapshot cannot be used (another configuration, a damaged file) starts again from
round 1, as every interrupted point did before.

``plateau_window`` (and ``plateau_delta``, ``plateau_metric``) in ``[base]`` stops each point once its curve
flattened (:mod:`wafl.common.plateau`; ``rounds`` is then the maximum): the point is finished all the same,
and its ``point.json`` records ``stop_reason`` (``"plateau"`` or ``"max_rounds"``) and ``rounds_run``.

``--first GLOB`` (repeatable; ``fnmatch`` patterns of point names, e.g. ``'*,num_clients=10,*'``) runs the
points that match one of them before the others, each group in the file's order: a table that takes several
sittings completes the slice its claims read first. It changes no point's configuration or numbers.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import json
import os
import platform
import shutil
import sys
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from wafl.cli.report.provenance import git_commit
from wafl.common.algorithms import registry
from wafl.common.config import ConfigError, RunConfig, flat_fields, load_config
from wafl.common.plateau import ran_to_end
from wafl.server.strategies import check_aggregation

DONE = "point.json"

# The kernels the points compute with. torch chooses its vector instruction set (and oneDNN its own) from
# the CPU, and its AVX-512 kernels add in another order than its AVX2 ones: the same point run on a machine
# with AVX-512 and on one without differs in its last bits at the first step, and by tenths of a point of
# accuracy after a few rounds. Sweep points on x86-64 use AVX2, which every such machine of the last
# decade has, unless the environment already names a set: a point's numbers are then the same on each.
# MKL (torch's BLAS: the linear layers' matrix products) picks its kernels from the CPU too, past both caps:
# on a machine with AMX the ASD table's FedAvg point differed from its record by 2.5 points at round 3 with
# only those two; MKL_CBWR=AVX2 (MKL's conditional numerical reproducibility) gives the results of its AVX2
# path on every CPU that has AVX2.
KERNEL_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2"}


@contextlib.contextmanager
def point_kernels() -> Iterator[None]:
    """:data:`KERNEL_ENV` in the environment (for the point processes started meanwhile) where the machine
    is x86-64 and the variable is not set already; restores the environment afterwards."""
    added = {}
    if platform.machine().lower() in ("x86_64", "amd64"):
        added = {k: v for k, v in KERNEL_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


SECTIONS = {"out", "base", "grid", "points", "extends", "params_for"}  # a sweep file's top-level keys


def load_sweep(path: Path) -> tuple[Path, list[tuple[str, RunConfig]]]:
    """The output folder and every point as ``(folder name, validated configuration)``, each point's
    aggregation rule checked (:func:`~wafl.server.strategies.check_aggregation`)."""
    if not path.is_file():
        raise ConfigError(f"sweep file {str(path)!r} does not exist")
    spec = _read_toml(path)
    unknown = sorted(set(spec) - SECTIONS)
    if unknown:
        raise ConfigError(
            f"sweep file {str(path)!r}: unknown section(s) {unknown}; known: {', '.join(sorted(SECTIONS))}"
        )
    spec = _extended(path, spec, [path.resolve()])
    params_for = _params_for(path, spec)
    base = flat_fields(spec.get("base", {}), check=False)
    grid = dict(spec.get("grid", {}))
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"sweep file {str(path)!r}: grid.{k} must be a non-empty list")
    overrides = [dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid else [{}]
    extra = spec.get("points", [])
    if extra:
        overrides = [{**o, **p} for p in extra for o in overrides] if grid else [dict(p) for p in extra]
    varying = sorted({k for o in overrides for k in o if len({json.dumps(x.get(k)) for x in overrides}) > 1})
    points: list[tuple[str, RunConfig]] = []
    for o in overrides:
        data = dict(base)
        own: dict[str, Any] = {}  # the point's own parameters
        for k, v in flat_fields(o, check=False).items():
            if k.startswith("params."):
                own[k[len("params.") :]] = v
            elif k == "params":
                if not isinstance(v, dict):
                    raise ConfigError(f"sweep point {o}: params must be a table of algorithm parameters")
                own.update(v)
            else:
                data[k] = v
        for_base = params_for.get(str(data.get("algorithm", "")).split("+")[0], {})
        data["params"] = {**base.get("params", {}), **for_base, **own}
        try:
            cfg = check_aggregation(load_config(None, data))
        except ConfigError as e:
            raise ConfigError(f"sweep point {o}: {e}") from None
        name = ",".join(f"{k}={_short(o[k])}" for k in varying if k in o) or "point"
        points.append((name, cfg))
    names = [n for n, _ in points]
    if len(set(names)) != len(names):
        raise ConfigError(f"sweep file {str(path)!r}: two points have the same settings")
    out = Path(spec.get("out") or Path("runs") / f"sweep-{path.stem}")
    return out, points


def _params_for(path: Path, spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The file's ``[params_for.<algorithm>]`` tables, checked to be tables of parameters."""
    found = spec.get("params_for", {})
    if not isinstance(found, dict) or not all(isinstance(v, dict) for v in found.values()):
        raise ConfigError(
            f"sweep file {str(path)!r}: params_for must hold one table of parameters per algorithm "
            '([params_for.fedspeed] then dual_mean = "all")'
        )
    return found


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"sweep file {str(path)!r} is not valid TOML: {e}") from None


def _extended(path: Path, spec: dict[str, Any], seen: list[Path]) -> dict[str, Any]:
    """``extends = "other.toml"`` (relative to this file): the other sweep's ``base``, ``grid`` and
    ``points``, this file's ``base`` fields over its ``base``, this file's ``grid`` lists in place of
    its lists of the same names, and this file's ``points`` (when it has any) in place of its points.
    ``out`` is never inherited (each file has its own folder)."""
    parent_name = spec.get("extends")
    if parent_name is None:
        return spec
    if not isinstance(parent_name, str) or not parent_name:
        raise ConfigError(f"sweep file {str(path)!r}: extends must name a sweep file (got {parent_name!r})")
    parent_path = (path.parent / parent_name).resolve()
    if parent_path in seen:
        raise ConfigError(f"sweep file {str(path)!r}: extends {parent_name!r} makes a loop")
    if not parent_path.is_file():
        raise ConfigError(f"sweep file {str(path)!r}: extends {parent_name!r}, which does not exist")
    parent = _extended(parent_path, _read_toml(parent_path), [*seen, parent_path])
    parent_base = flat_fields(parent.get("base", {}), check=False)
    own_base = flat_fields(spec.get("base", {}), check=False)
    base = {**parent_base, **own_base}
    if "params" in parent_base and "params" in own_base:
        base["params"] = {**parent_base["params"], **own_base["params"]}
    merged: dict[str, Any] = {"base": base, "grid": {**parent.get("grid", {}), **spec.get("grid", {})}}
    params_for = {**_params_for(parent_path, parent)}
    for algorithm, given in _params_for(path, spec).items():
        params_for[algorithm] = {**params_for.get(algorithm, {}), **given}
    if params_for:
        merged["params_for"] = params_for
    points = spec.get("points") or parent.get("points")
    if points:
        merged["points"] = points
    if "out" in spec:
        merged["out"] = spec["out"]
    return merged


def _short(v: Any) -> str:
    return str(v).replace("/", "_").replace(" ", "")


def run_point(
    cfg_json: str, folder: str, network: bool, slot_processes: int = 0, snapshot_every: int = 0
) -> dict[str, Any]:
    """Runs one point into ``folder`` (in a worker process); returns its outcome. ``slot_processes``:
    in process, a compute-and-wait point's clients train in that many forked processes.

    In process, a point that can resume exactly (:func:`~wafl.cli.sim.resume.not_resumable`) takes snapshots
    into ``folder/resume`` (every ``snapshot_every`` rounds; 0: as their cost allows) and resumes from the
    one it finds there; any other point, and a point without a usable snapshot, starts from round 1. The
    outcome's ``wall_s`` sums the sittings."""
    import torch

    torch.set_num_threads(1)
    cfg = check_aggregation(RunConfig.from_json(cfg_json).validate())
    out = Path(folder)
    t0 = time.monotonic()
    snapshots = None
    if not network:
        from wafl.cli.sim.resume import Snapshots, not_resumable
        from wafl.common.logs import configure_logging

        configure_logging("sweep", out / "logs" / "run.jsonl", level="INFO", console=False)
        if not_resumable(cfg) is None:
            snapshots = Snapshots(out, cfg, snapshot_every, tag=git_commit() or "")
    if snapshots is None or snapshots.found is None:  # from round 1: nothing of an earlier sitting stays
        shutil.rmtree(out / "resume", ignore_errors=True)
        for stale in ("results.jsonl", "reports.jsonl", "timelines.json", "checkpoint.pt"):
            (out / stale).unlink(missing_ok=True)
        shutil.rmtree(out / "clients", ignore_errors=True)
    if network:  # a point imports only what its kind of run needs (the engine, gRPC, torch: in this process)
        from wafl.cli.launch.launcher import launch

        summary = launch(cfg, out, show_progress=False)
        ok, rows = summary.ok, summary.rows
    else:
        from wafl.cli.sim.simulate import simulate, trains_in_processes

        processes = slot_processes if trains_in_processes(cfg) else 0  # a wait-free point trains in threads
        rows = simulate(cfg, out, slot_processes=processes, snapshots=snapshots)
        ok = ran_to_end(rows, cfg.federation.rounds)
    earlier_s = snapshots.earlier_s if snapshots is not None else 0.0
    result = {
        "ok": ok,
        "wall_s": round(earlier_s + time.monotonic() - t0, 3),
        "network": network,
        "commit": git_commit(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the kernels it ran (see KERNEL_ENV)
        "kernels": {k: os.environ[k] for k in sorted(KERNEL_ENV) if k in os.environ},
    }
    if cfg.evaluation.plateau_window and rows:  # why it stopped (wafl.common.plateau), and when
        result.update(stop_reason=rows[-1].get("stop_reason"), rounds_run=int(rows[-1]["round"]))
    if ok:
        (out / DONE).write_text(json.dumps(result) + "\n")
        if snapshots is not None:
            snapshots.clear()  # after point.json: a kill in between leaves a finished point
    return result


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """How the flat configuration ``new`` differs from ``old`` (a finished point's ``config.json``), one
    ``"field: old -> new"`` a field; a field ``old`` lacks (added to the configuration since) counts as its
    default. ``params`` compare key by key (``params.name``) with no such default: a point written before a
    parameter existed differs from one that resolves it, since the parameter's default need not be the
    earlier behaviour, unless the algorithm declares the value it had before (``param(before=...)``,
    :func:`~wafl.common.algorithms.registry.earlier`)."""
    defaults = json.loads(RunConfig().to_json())
    earlier = registry.earlier(str(new.get("algorithm", "")))
    found = []
    for k in sorted(set(old) | set(new)):
        want, have = old.get(k, defaults.get(k)), new.get(k)
        if isinstance(want, dict) and isinstance(have, dict):
            if k == "params":
                want = {**earlier, **want}
            for q in sorted(set(want) | set(have)):
                if want.get(q, "(none)") != have.get(q, "(none)"):
                    found.append(f"{k}.{q}: {want.get(q, '(none)')!r} -> {have.get(q, '(none)')!r}")
        elif have != want:
            found.append(f"{k}: {want!r} -> {have!r}")
    return found


def stale_points(out: Path, points: list[tuple[str, RunConfig]]) -> dict[str, list[str]]:
    """The finished points of ``out`` whose ``config.json`` is not the sweep file's configuration of the point
    (the sweep file or a default changed since they ran), each with its :func:`config_changes`."""
    stale = {}
    for n, cfg in points:
        path = out / n / "config.json"
        if (out / n / DONE).exists() and path.is_file():
            changes = config_changes(json.loads(path.read_text()), json.loads(cfg.to_json()))
            if changes:
                stale[n] = changes
    return stale


def matching(names: list[str], patterns: list[str], option: str) -> list[str]:
    """The ``names`` (point names, in their order) that match one of ``patterns`` (``fnmatch``, case as written);
    a pattern that matches none is a :class:`ConfigError` that names it and ``option``."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(f"{option} {pattern!r} matches no point of the sweep")
    return [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]


def first_order(points: list[tuple[str, RunConfig]], patterns: list[str]) -> list[tuple[str, RunConfig]]:
    """The points whose names match one of ``patterns`` (:func:`matching`), then the others, each in the file's
    order."""
    ahead = set(matching([n for n, _ in points], patterns, "--first"))
    return [p for p in points if p[0] in ahead] + [p for p in points if p[0] not in ahead]


def sweep(
    path: Path,
    network: bool = False,
    jobs: int = 1,
    out: Path | None = None,
    show_progress: bool = True,
    slot_processes: int = 0,
    snapshot_every: int = 0,
    first: list[str] | None = None,
) -> int:
    """Runs every point not yet done; 0 when every point has finished. ``slot_processes`` (in process):
    each compute-and-wait point trains its clients in that many forked processes
    (:class:`~wafl.client.process_slots.ProcessSlots`), the others in threads as without it.
    ``snapshot_every``: rounds between two snapshots of an in-process point (0: as their cost allows;
    :func:`run_point`). ``first``: name patterns of the points to run before the others (:func:`first_order`)."""
    default_out, points = load_sweep(path)
    points = first_order(points, first or [])
    if network:
        from wafl.server.app import check_networked

        for _, cfg in points:
            check_networked(cfg)
    out = out or default_out
    out.mkdir(parents=True, exist_ok=True)
    stale = stale_points(out, points)
    if stale:
        shown = "; ".join(f"{n} ({', '.join(c)})" for n, c in list(stale.items())[:3])
        raise ConfigError(
            f"{len(stale)} finished point(s) in {out} ran with another configuration than {path} gives them now: "
            f"{shown}{' ...' if len(stale) > 3 else ''}; remove their folders to run them again, or use another --out"
        )
    todo = [(n, c) for n, c in points if not (out / n / DONE).exists()]
    for n, _ in points:  # a point killed after its point.json, before it removed its snapshots
        if (out / n / DONE).exists():
            shutil.rmtree(out / n / "resume", ignore_errors=True)
    done = len(points) - len(todo)
    failed: list[str] = []

    def progress(note: str) -> None:
        if show_progress:
            width = 30
            filled = int(width * done / max(1, len(points)))
            print(f"points {done:>3}/{len(points)} [{'#' * filled}{'.' * (width - filled)}] {note}", file=sys.stderr)

    progress(f"{out}: {len(todo)} to run" + (f", {done} already done" if done else ""))
    ctx = get_context("spawn")  # fresh interpreters: no torch state shared between points
    with point_kernels(), ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as pool:
        futures = {}
        for name, cfg in todo:
            (out / name).mkdir(parents=True, exist_ok=True)
            job = (cfg.to_json(), str(out / name), network, slot_processes, snapshot_every)
            futures[pool.submit(run_point, *job)] = name
        for f in as_completed(futures):
            name = futures[f]
            try:
                result = f.result()
            except Exception as e:  # a point that crashed is reported, the others go on
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            if result.get("ok"):
                done += 1
                progress(f"{name} ({result['wall_s']:.0f} s)")
            else:
                failed.append(name)
                progress(f"{name} FAILED {result.get('error', '')}")
    if failed:
        print(
            f"wafl: {len(failed)} point(s) failed: {', '.join(failed)}; run the sweep again to retry them",
            file=sys.stderr,
        )
    else:
        print(f"wafl: every point is done; `wafl table {out}` makes the table", file=sys.stderr)
    return 1 if failed else 0

"""``wafl run``: a whole federation on this machine (or, with ``--ray``, on a Ray cluster)."""

from __future__ import annotations

import argparse
from pathlib import Path

from wafl.cli.commands.preflight import OFF, check_dataset, creatable, run_hosts, workers
from wafl.cli.config_flags import resolve_config
from wafl.common.config import ConfigError, RunConfig
from wafl.common.errors import UsageError


def cmd_run(a: argparse.Namespace) -> int:
    from wafl.cli.launch.launcher import launch
    from wafl.client.trainer import resolve_device

    cfg = resolve_config(a)
    if a.out and (Path(a.out) / "results.jsonl").exists():
        raise UsageError(f"--out {a.out} already holds a run (results.jsonl): choose another folder")
    if a.ray is not None:
        return _run_on_ray(a, cfg)
    device = resolve_device(cfg.training.device)  # every client runs here: a missing GPU is an error now, not at join
    check_dataset(cfg)
    if a.out:
        creatable(Path(a.out))
    hosts = run_hosts(a, cfg)  # --link-rate, --host-cpus and --workers parsed here, once
    if a.slots is not None and (hosts.workers is None or a.slots < 1):
        raise ConfigError(f"--slots={a.slots} needs --workers (not off or 0) and must be at least 1")
    summary = launch(
        cfg,
        Path(a.out) if a.out else None,
        hosts=hosts,
        show_progress=not a.quiet,
        timeout_s=a.timeout,
        slots=a.slots,
        # this process is the command: the run's processes fork from it (wafl.cli.launch.forking), except where they
        # use CUDA, which this process may have initialized by looking for it (CUDA does not survive a fork);
        # a.entry: wafl.cli.main.main, set by it
        fork=getattr(a, "entry", None) if device.type == "cpu" else None,
    )
    return 0 if summary.ok else 1


def _run_on_ray(a: argparse.Namespace, cfg: RunConfig) -> int:
    """``wafl run --ray [ADDRESS]``: the server and the workers as actors on a Ray cluster (the clients run
    on its nodes, so their device is not checked here)."""
    from wafl.cli.launch.raylaunch import import_ray, launch_ray

    import_ray()  # one line when Ray is not installed, before anything else
    if a.link_rate or (a.host_cpus or "none") != "none":
        raise UsageError("--ray places workers on a cluster: it has no per-client links (--link-rate) or CPU shares")
    n_workers = None if a.workers in (None, "auto") else workers(a.workers, cfg, False)
    if a.workers in OFF:
        raise UsageError(f"--ray runs the clients in worker actors: --workers {a.workers} is not available with it")
    check_dataset(cfg)  # the server actor starts on this node when it has room
    if a.out:
        creatable(Path(a.out))
    summary = launch_ray(
        cfg,
        Path(a.out) if a.out else None,
        address=a.ray or None,
        workers=n_workers,
        slots=a.slots,
        worker_cpus=a.ray_worker_cpus,
        worker_gpus=a.ray_worker_gpus,
        server_cpus=a.ray_server_cpus,
        max_restarts=a.ray_max_restarts,
        show_progress=not a.quiet,
        timeout_s=a.timeout,
    )
    return 0 if summary.ok else 1

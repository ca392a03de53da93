"""``wafl bench protocols`` and ``wafl bench async``: the flags checked, then the measurement run."""

from __future__ import annotations

import argparse
from pathlib import Path

from wafl.cli.config_flags import resolve_config
from wafl.cli.launch.measured import measured_hosts
from wafl.common.config import ConfigError

# the configuration of ``wafl bench async`` where neither its flags nor --set give one
ASYNC_DEFAULTS = {
    "algorithm": "ditto",
    "num_clients": 8,
    "slowdown": "lognormal:sigma=1",
    "rounds": 15,
    "buffer_size": 6,
}


def cmd_bench(a: argparse.Namespace) -> int:
    from wafl.cli.experiments.bench import bench_order, bench_protocols

    protocols = [p.strip() for p in a.protocols.split(",") if p.strip()]
    try:
        bench_order(protocols)
    except ValueError as e:
        raise ConfigError(f"--protocols: {e}") from None
    cfg = resolve_config(a)
    hosts = measured_hosts(cfg, a.link_rate, a.host_cpus)  # parsed once, here: a bad flag is named before any run
    return bench_protocols(
        cfg,
        Path(a.out),
        hosts=hosts,
        target=a.target,
        show_progress=not a.quiet,
        same_rounds=a.same_rounds,
        protocols=protocols,
    )


def cmd_bench_async(a: argparse.Namespace) -> int:
    from wafl.cli.experiments.bench_async import bench_async

    for k, v in ASYNC_DEFAULTS.items():
        if getattr(a, k, None) is None and k not in dict(a.set):
            setattr(a, k, v)
    cfg = resolve_config(a)
    if a.versions_factor < 1:
        raise ConfigError(f"--versions-factor={a.versions_factor} must be >= 1")
    hosts = measured_hosts(cfg, a.link_rate, a.host_cpus)
    return bench_async(
        cfg,
        Path(a.out),
        hosts=hosts,
        target=a.target,
        show_progress=not a.quiet,
        versions_factor=a.versions_factor,
    )

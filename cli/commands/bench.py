"""``wafl bench protocols`` and ``wafl bench async``: the flags checked, then the measurement run."""

from __future__ import annotations

import argparse
from pathlib import Path

from wafl.cli.commands.preflight import check_host_cpus, check_link_rate
from wafl.cli.config_flags import resolve_config
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
    check_link_rate(a.link_rate, cfg)
    check_host_cpus(a.host_cpus, cfg)
    return bench_protocols(
        cfg,
        Path(a.out),
        link_rate=a.link_rate,
        target=a.target,
        show_progress=not a.quiet,
        host_cpus=a.host_cpus,
        same_rounds=a.same_rounds,
        protocols=protocols,
    )


def cmd_bench_async(a: argparse.Namespace) -> int:
    from wafl.cli.experiments.bench_async import bench_async

    for k, v in ASYNC_DEFAULTS.items():
        if getattr(a, k, None) is None and k not in dict(a.set):
            setattr(a, k, v)
    cfg = resolve_config(a)
    check_link_rate(a.link_rate, cfg)
    check_host_cpus(a.host_cpus, cfg)
    if a.versions_factor < 1:
        raise ConfigError(f"--versions-factor={a.versions_factor} must be >= 1")
    return bench_async(
        cfg,
        Path(a.out),
        link_rate=a.link_rate,
        target=a.target,
        show_progress=not a.quiet,
        host_cpus=a.host_cpus,
        versions_factor=a.versions_factor,
    )

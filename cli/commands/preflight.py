"""The checks a command makes before any process of a run starts: the dataset loads, the output folder
can be made, ``--link-rate`` and ``--host-cpus`` parse for the run, and ``--workers`` names a count. ``wafl run``
gets them parsed (:func:`run_hosts`, a :class:`wafl.cli.launch.hosts.Hosts` that the launcher takes); ``wafl
bench`` gets its :class:`~wafl.cli.launch.hosts.Hosts` from :func:`wafl.cli.launch.measured.measured_hosts`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from wafl.cli.launch.hosts import Hosts, parse_hosts
from wafl.common.config import ConfigError, RunConfig
from wafl.common.errors import UsageError

OFF = ("off", "0")  # --workers off / 0: one process per client


def workers(spec: str | None, cfg: RunConfig, per_client_hosts: bool) -> int | None:
    """``--workers``: a count, ``auto`` (one per core, at most one per client) or ``off``/``0`` (one process
    per client); unset: ``auto``, or ``off`` with per-client links or CPU shares (a namespace or a control
    group holds one process)."""
    from wafl.cli.launch.launcher import check_workers, default_workers  # the launcher: not in `wafl --help`

    if spec is None:
        spec = "off" if per_client_hosts else "auto"
    if spec in OFF:
        return None
    if spec == "auto":
        return default_workers(cfg.federation.num_clients)
    try:
        n = int(spec)
    except ValueError:
        raise UsageError(f"--workers={spec!r} is not a count, auto or off") from None
    return check_workers(n, cfg)


def run_hosts(a: argparse.Namespace, cfg: RunConfig) -> Hosts:
    """``wafl run``'s ``--link-rate``, ``--host-cpus`` and ``--workers``, parsed once for ``cfg`` (a
    :class:`ConfigError` or :class:`UsageError` naming the flag otherwise): what
    :func:`wafl.cli.launch.launcher.launch` takes."""
    hosts = parse_hosts(cfg, link_rate=a.link_rate, host_cpus=a.host_cpus)
    return dataclasses.replace(hosts, workers=workers(a.workers, cfg, hosts.per_client))


def check_dataset(cfg: RunConfig) -> None:
    """The run's dataset loads here (its files are present and readable) before any process starts."""
    from wafl.common.datasets import load_dataset  # torch: not loaded by the commands that do not run

    size, n = cfg.data.client_size, cfg.federation.num_clients
    data = load_dataset(cfg.data.dataset, cfg.data.data_dir)
    if size is not None and size * n > len(data.train_labels):
        raise ConfigError(
            f"client_size={size} for {n} clients needs {size * n} "
            f"samples; {cfg.data.dataset}'s training split has {len(data.train_labels)}"
        )


def creatable(out: Path) -> None:
    """``--out`` exists or can be made (a :class:`UsageError` naming the flag otherwise)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out} cannot be created: {e.strerror}") from None

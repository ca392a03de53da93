"""``wafl client`` (one client of a run) and ``wafl worker`` (many clients of a run in one process)."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from wafl.cli.commands.process import set_threads, setup_logging
from wafl.cli.tokens import read_token
from wafl.common.config import ConfigError


def _client_setup(a: argparse.Namespace, log_name: str) -> dict[str, Any]:
    """What `wafl client` and `wafl worker` share: TLS, logging and threads set up, and the keyword
    arguments of their clients' sessions (state folder, data, device, token, reconnect limit, TLS)."""
    from wafl.common.tls import client_tls

    tls = client_tls(a.tls_ca, a.tls_server_name, a.tls_cert, a.tls_key)
    setup_logging(log_name, a.log_file, a.quiet)
    set_threads(a.threads)
    return {
        "state_dir": Path(a.state_dir) if a.state_dir else None,
        "data_dir": a.data_dir,
        "device": a.device,
        "token": read_token(a),
        "reconnect_s": a.reconnect_s,
        "tls": tls,
    }


def cmd_client(a: argparse.Namespace) -> int:
    from wafl.client.app import run_client

    return asyncio.run(run_client(a.server, a.index, **_client_setup(a, f"client-{a.index}")))


def cmd_worker(a: argparse.Namespace) -> int:
    from wafl.client.worker import format_indices, parse_indices, run_worker

    indices = parse_indices(a.clients)
    slots = a.slots if a.slots is not None else len(os.sched_getaffinity(0))
    if slots < 1:
        raise ConfigError(f"--slots={slots} must be at least 1")
    setup = _client_setup(a, f"worker-{format_indices(indices)}")
    return asyncio.run(run_worker(a.server, indices, slots, **setup))

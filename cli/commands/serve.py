"""``wafl server``: the aggregation server of one run."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from wafl.cli.commands.process import set_threads, setup_logging
from wafl.cli.config_flags import resolve_config
from wafl.cli.tokens import read_token


def cmd_server(a: argparse.Namespace) -> int:
    from wafl.server.app import check_out_dir, serve

    cfg = resolve_config(a)
    out = Path(a.out)
    check_out_dir(out, a.resume)
    setup_logging("server", a.log_file or str(out / "logs" / "server.jsonl"), a.quiet)
    set_threads(a.threads)
    from wafl.common.tls import server_tls
    from wafl.server.auth import load_enrollment

    tls = server_tls(a.tls_cert, a.tls_key, a.tls_client_ca)
    enrollment = load_enrollment(a.enrollment, cfg.federation.num_clients) if a.enrollment else None
    return asyncio.run(
        serve(
            cfg,
            a.host,
            a.port,
            out,
            token=read_token(a),
            resume=a.resume,
            ready_file=Path(a.ready_file) if a.ready_file else None,
            tls=tls,
            enrollment=enrollment,
            allow_open=a.allow_open,
        )
    )

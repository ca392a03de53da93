"""``wafl client``: join a federation, follow its broadcasts, train and upload until the end."""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
from wafl.client.startup import Connection, HostedClient, start
from wafl.client.trainer import Trainer
from wafl.common.tls import ClientTls

log = structlog.get_logger("client")


async def run_client(
    address: str,
    index: int,
    state_dir: Path | None = None,
    data_dir: str | None = None,
    device: str | None = None,
    token: str = "",
    reconnect_s: float = 120.0,
    threads: int | None = None,
    tls: ClientTls | None = None,
) -> int:
    """Runs one client to the end of the run; returns 0 on success."""
    if threads:
        torch.set_num_threads(threads)
    conn = Connection(address, token, reconnect_s, tls, state_dir)
    cfg, dev, (trainer,) = await start(
        conn, [index], device, lambda cfg, dev: [Trainer(cfg, index, state_dir, data_dir, dev)]
    )
    client = HostedClient(conn, trainer, dev)
    await client.run(
        on_joined=lambda: log.info(
            "client.ready",
            client=client.client_id,
            samples=trainer.num_samples,
            local_test=len(trainer.test_idx),
            device=dev,
            protocol="new client" if trainer.is_new else cfg.client.protocol,
        )
    )
    return 0

"""``wafl client``: join a federation, follow its broadcasts, train and upload until the end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch
from wafl.client.protocol import client_protocol
from wafl.client.session import Session, credential_path
from wafl.client.trainer import Trainer, resolve_device
from wafl.common.config import RunConfig
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
    client_id = f"client-{index}"
    # The first optimizer call imports torch._dynamo (seconds of CPU): do it while joining, not in round 1.
    warm = asyncio.create_task(asyncio.to_thread(warm_up_torch))
    probe = Session(address, client_id, index, 0, token=token, reconnect_s=reconnect_s, tls=tls)
    reply = await probe.join()  # num_samples=0: the configuration, without registering
    await probe.close()
    cfg = RunConfig.from_json(reply.config_json).validate()
    dev = str(resolve_device(device or cfg.device))
    trainer = await _to_thread(Trainer, cfg, index, state_dir, data_dir, dev)
    session = Session(
        address,
        client_id,
        index,
        trainer.num_samples,
        device=dev,
        token=token,
        reconnect_s=reconnect_s,
        tls=tls,
        credential_file=credential_path(state_dir, index),
    )
    await warm
    await session.join()
    log.info(
        "client.ready",
        client=client_id,
        samples=trainer.num_samples,
        local_test=len(trainer.test_idx),
        device=dev,
        protocol="new client" if trainer.is_new else cfg.protocol,
    )
    try:
        await client_protocol(session, trainer).run()
    finally:
        await session.close()
    return 0


T = TypeVar("T")


async def _to_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(fn, *args)


def warm_up_torch() -> None:
    """One optimizer step on a scalar: pays torch's lazy imports before the run starts."""
    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=0.0)
    p.sum().backward()
    opt.step()
    opt.zero_grad()

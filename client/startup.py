"""How the clients of a process start and end, one path for ``wafl client`` (one client) and ``wafl worker``
(many): the run's configuration from a probe join, the trainers built while torch warms up, then per
client a session that joins with its credential, the round protocol of the run, and the session closed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from wafl.client.protocol import NewClientProtocol, RoundProtocol, client_protocol
from wafl.client.reception import SharedReception
from wafl.client.session import Session, credential_path
from wafl.client.trainer import Trainer, resolve_device
from wafl.common.config import ConfigError, RunConfig
from wafl.common.tls import ClientTls


@dataclass(frozen=True)
class Connection:
    """How a process's clients reach the server (address, token, reconnect limit, TLS) and where they keep
    their session credentials (``state_dir``, beside their state files; None: nowhere)."""

    address: str
    token: str = ""
    reconnect_s: float = 120.0
    tls: ClientTls | None = None
    state_dir: Path | None = None

    def probe(self, index: int) -> Session:
        """A session that joins as ``index`` with ``num_samples=0``: the configuration, without registering."""
        return Session(
            self.address, f"client-{index}", index, 0, token=self.token, reconnect_s=self.reconnect_s, tls=self.tls
        )

    def session(self, trainer: Trainer, device: str, reception: SharedReception | None = None) -> Session:
        """The session of ``trainer``'s client: its index, samples and device, its credential file."""
        return Session(
            self.address,
            f"client-{trainer.index}",
            trainer.index,
            trainer.num_samples,
            device=device,
            token=self.token,
            reconnect_s=self.reconnect_s,
            tls=self.tls,
            credential_file=credential_path(self.state_dir, trainer.index),
            reception=reception,
        )


async def start(
    conn: Connection,
    indices: Sequence[int],
    device: str | None,
    build: Callable[[RunConfig, str], list[Trainer]],
) -> tuple[RunConfig, str, list[Trainer]]:
    """The run's configuration (a probe join as ``indices[0]``), the device (``device``, else the run's) and
    ``build(cfg, device)``'s trainers of the clients ``indices``, built in a thread while torch warms up."""
    # The first optimizer call imports torch._dynamo (seconds of CPU): do it while joining, not in round 1.
    warm = asyncio.create_task(asyncio.to_thread(warm_up_torch))
    probe = conn.probe(indices[0])
    reply = await probe.join()
    await probe.close()
    cfg = RunConfig.from_json(reply.config_json).validate()
    if max(indices) >= cfg.federation.num_clients:
        raise ConfigError(f"client index {max(indices)} is outside 0..{cfg.federation.num_clients - 1} of this run")
    dev = str(resolve_device(device or cfg.training.device))
    trainers = await asyncio.to_thread(build, cfg, dev)
    await warm
    return cfg, dev, trainers


class HostedClient:
    """One client of this process: its trainer, its session and, once joined, its round protocol."""

    def __init__(
        self,
        conn: Connection,
        trainer: Trainer,
        device: str,
        compute: Any = None,
        reception: SharedReception | None = None,
    ) -> None:
        self.trainer = trainer
        self.client_id = f"client-{trainer.index}"
        self.session = conn.session(trainer, device, reception)
        self.compute = compute
        self.protocol: RoundProtocol | NewClientProtocol | None = None

    async def run(self, joining: asyncio.Semaphore | None = None, on_joined: Callable[[], None] | None = None) -> None:
        """Joins (one of ``joining``'s joins in flight), calls ``on_joined``, runs the protocol to the end of
        the run; the session is closed however it ends."""
        try:
            if joining is None:
                await self.session.join()
            else:
                async with joining:
                    await self.session.join()
            if on_joined is not None:
                on_joined()
            self.protocol = client_protocol(self.session, self.trainer, self.compute)
            await self.protocol.run()
        finally:
            await self.session.close()


def warm_up_torch() -> None:
    """One optimizer step on a scalar: pays torch's lazy imports before the run starts."""
    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=0.0)
    p.sum().backward()
    opt.step()
    opt.zero_grad()

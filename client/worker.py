"""``wafl worker``: one process hosting many clients of a federation.

Each hosted client is the client of ``wafl client``: its own :class:`~wafl.client.session.Session`
(identity, credential, broadcast stream, reconnects), its own :class:`~wafl.client.trainer.Trainer`
(data shard, GM, PM, optimizer and algorithm state, kept in memory between rounds and in
``state_dir`` across restarts) and its own :class:`~wafl.client.protocol.RoundProtocol`
(wait-free or compute-and-wait, unchanged), all in one asyncio loop. What they share is the
dataset (loaded once), one buffer per broadcast they all receive
(:class:`~wafl.client.reception.SharedReception`) and a bounded pool of ``slots`` training slots
(:class:`~wafl.client.compute.SharedSlots`): work the federation waits for (loading a
broadcast, GM training, the upload's tensors, the compute-and-wait PM, evaluation) always gets
a free slot before the wait-free PM, which only fills slots nobody else waits for. On an
accelerator a :class:`~wafl.client.residency.Residency` keeps only about ``slots`` clients'
tensors on the device and the others' in host memory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog
import torch
from wafl.client.compute import SharedSlots
from wafl.client.reception import SharedReception
from wafl.client.residency import Residency
from wafl.client.startup import Connection, HostedClient, start
from wafl.client.trainer import Trainer
from wafl.common.config import ConfigError, RunConfig
from wafl.common.datasets import load_dataset
from wafl.common.tls import ClientTls

log = structlog.get_logger("client")
# Joins in flight per worker: a worker's hundreds of clients joining at once queue at the server
# beyond a Join's deadline, and a client whose Join the server registered after the deadline is
# refused when it retries without the credential it never received.
JOINS_AT_ONCE = 16


def parse_indices(spec: str) -> list[int]:
    """``"0-9"``, ``"3"``, ``"0-4,10,12-13"`` -> the client indices, in order, without repeats."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigError(f"client indices {spec!r}: {part!r} is not an index or a range LOW-HIGH") from None
    if any(i < 0 for i in out):
        raise ConfigError(f"client indices {spec!r} must not be negative")
    if len(set(out)) != len(out):
        raise ConfigError(f"client indices {spec!r} name a client twice")
    return out


def format_indices(indices: list[int]) -> str:
    """The shortest :func:`parse_indices` spelling of ``indices`` (runs of consecutive indices as ranges)."""
    parts: list[str] = []
    i = 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        parts.append(str(indices[i]) if i == j else f"{indices[i]}-{indices[j]}")
        i = j + 1
    return ",".join(parts)


async def run_worker(
    address: str,
    indices: list[int],
    slots: int = 1,
    state_dir: Path | None = None,
    data_dir: str | None = None,
    device: str | None = None,
    token: str = "",
    reconnect_s: float = 120.0,
    tls: ClientTls | None = None,
) -> int:
    """Runs the clients ``indices`` to the end of the run in this process; 0 when every one finished."""
    if not indices:
        raise ConfigError("a worker needs at least one client index")
    conn = Connection(address, token, reconnect_s, tls, state_dir)

    def build(cfg: RunConfig, dev: str) -> list[Trainer]:
        data = load_dataset(cfg.data.dataset, data_dir or cfg.data.data_dir)  # loaded once, shared by every client
        # one after another: each trainer seeds torch's global generator before building its model
        return [Trainer(cfg, i, state_dir, data_dir, dev, data) for i in indices]

    _, dev, trainers = await start(conn, indices, device, build)
    # on an accelerator only the clients training (or last trained) keep their tensors there
    pool = SharedSlots(slots, Residency(slots) if torch.device(dev).type != "cpu" else None)
    joining = asyncio.Semaphore(JOINS_AT_ONCE)
    reception = SharedReception()
    clients = [HostedClient(conn, t, dev, pool.view(t), reception) for t in trainers]
    log.info("worker.ready", clients=len(clients), first=indices[0], last=indices[-1], slots=slots, device=dev)
    try:
        results = await asyncio.gather(*(_hosted(c, joining) for c in clients), return_exceptions=True)
    finally:
        pool.shutdown()
    failed = [(c.client_id, r) for c, r in zip(clients, results) if isinstance(r, BaseException)]
    for client_id, e in failed:
        log.error("client.failed", client=client_id, error=f"{type(e).__name__}: {e}")
    log.info(
        "worker.done",
        clients=len(clients),
        failed=len(failed),
        slots_held_max=pool.busy_max,
        broadcasts_shared=reception.shared,
        broadcasts_alone=reception.alone,
        **(
            {
                "resident_max": pool.residency.resident_max,
                "offloads": pool.residency.offloads,
                "onloads": pool.residency.onloads,
            }
            if pool.residency is not None
            else {}
        ),
    )
    if failed and all(isinstance(r, ConnectionError) for _, r in failed) and len(failed) == len(clients):
        raise failed[0][1]  # every client gave up on the server: one line and exit 1, as a client does
    return 1 if failed else 0


async def _hosted(client: HostedClient, joining: asyncio.Semaphore) -> None:
    structlog.contextvars.bind_contextvars(client=client.client_id)  # this task's log lines name their client
    await client.run(joining)

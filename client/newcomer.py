"""A new client's run (``new_clients``, :mod:`wafl.common.newcomers`): join, wait, adapt when told.

It trains nothing for the federation and uploads nothing. Each model it is sent carries
``adapt`` (the server sends it the global model of every evaluated round, the last one as the
final model): it adapts that model (:meth:`~wafl.client.trainer.Trainer.adapt`) for
``new_client_epochs`` epochs, tests it on its local test split and reports
``new_client_accuracy`` for the round the model closed; after the final model it sends the final
report every client sends. The same object runs over gRPC (:class:`~wafl.client.session.Session`)
and in process (:class:`~wafl.cli.local_transport.LocalSession`).
"""

from __future__ import annotations

from typing import Any

import structlog
from wafl.client.compute import OwnThreads
from wafl.client.protocol import RoundProtocol, Transport
from wafl.client.timeline import Timeline
from wafl.client.trainer import Trainer
from wafl.common import metrics as M
from wafl.common.codec import crc32_of

log = structlog.get_logger("client")


class NewClientProtocol:
    def __init__(self, session: Transport, trainer: Trainer, compute: Any = None) -> None:
        """``compute``: where the adaptation runs (:mod:`wafl.client.compute`); default: this client's own threads."""
        self.session = session
        self.trainer = trainer
        self.timeline = Timeline()
        self.compute = compute or OwnThreads(False)
        self.adapted: list[int] = []  # the rounds whose global model it adapted

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.compute.close()

    async def _run(self) -> None:
        t = self.trainer
        async for model in self.session.models():
            r = model.round - 1  # the round whose aggregation made this model
            if model.adapt:
                with self.timeline.phase("evaluate", r):
                    acc, n = await self.compute.run(
                        t.adapt, model.round, model.state, model.knowledge, t.cfg.new_client_epochs
                    )
                self.adapted.append(r)
                log.info("new_client.adapted", round=r, accuracy=round(acc, 6), test_samples=n)
                if n:  # an empty local test set has no accuracy to report
                    metrics = {M.NEW_CLIENT_ACCURACY: acc, M.NEW_CLIENT_TEST_SAMPLES: float(n)}
                    await self.session.report(r, metrics)
            if model.final:
                final = {M.FINAL: 1.0, M.BYTES_UP: 0.0, M.GLOBAL_CRC32: float(crc32_of(model.state.values()))}
                await self.session.report(r, final, self.timeline.events, self.timeline.start_unix)
                log.info("run.final", round=r)
                return


def client_protocol(session: Transport, trainer: Trainer, compute: Any = None) -> RoundProtocol | NewClientProtocol:
    """What runs a client: the round protocol of its configuration, or a new client's wait-and-adapt."""
    if trainer.is_new:
        return NewClientProtocol(session, trainer, compute)
    return RoundProtocol(session, trainer, trainer.cfg.protocol, compute)

"""What a chaos client records, installed in a forked ``wafl client`` before it starts (benchmarks/chaos.py).

The client is the real one (``wafl.cli.main client``); these wrappers only observe and, on request, stall it:

* ``upload.begin`` (round, idempotency key) when an upload's header is built, ``upload.ack`` (round, bytes)
  when :meth:`wafl.client.session.Session.upload` returns bytes the server acknowledged, ``upload.unacked``
  when it returns 0 (refused or already accepted under another key): one JSON line each, flushed at once,
  in the client's events file, with the wall-clock time ``t`` (``time.time()``);
* mid-upload faults: when the driver has written ``stop`` in this client's flag file, the upload stream
  stops itself (SIGSTOP) after its header and first transfer message, and the driver then kills it;
  with ``hold`` the stream pauses ``hold`` seconds there (the driver cuts the link meanwhile).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any


def install(events: Path, flag: Path) -> None:
    """Wraps the upload path of :mod:`wafl.client.session` in this process."""
    from wafl.client import session as S

    out = open(events, "a", buffering=1)  # noqa: SIM115 - the process's lifetime

    def emit(event: str, **fields: Any) -> None:
        out.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        out.flush()

    orig_header = S.upload_header
    orig_messages = S.upload_messages
    orig_upload = S.Session.upload

    def upload_header(run_id: str, round: int, client_id: str, num_samples: int, key: str, metrics: Any) -> Any:
        emit("upload.begin", round=round, key=key, client=client_id)
        return orig_header(run_id, round, client_id, num_samples, key, metrics)

    async def upload_messages(header: Any, state: Any, knowledge: Any) -> AsyncIterator[object]:
        n = 0
        async for m in orig_messages(header, state, knowledge):
            yield m
            n += 1
            if n == 2:
                try:
                    order = flag.read_text().split()
                    flag.unlink()
                except OSError:
                    order = []
                if order[:1] == ["stop"]:
                    emit("upload.stopped", round=header.round)
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif order[:1] == ["hold"]:
                    emit("upload.held", round=header.round)
                    await asyncio.sleep(float(order[1]) if len(order) > 1 else 3.0)

    async def upload(self: Any, round: int, *args: Any, **kwargs: Any) -> int:
        n = await orig_upload(self, round, *args, **kwargs)
        emit("upload.ack" if n > 0 else "upload.unacked", round=round, bytes=n, client=self.client_id)
        return n

    S.upload_header = upload_header
    S.upload_messages = upload_messages
    S.Session.upload = upload

"""An upload's cleanup (rollback, release of its place, settling its attempt) finishes even when
the handler's task is cancelled again while it runs: a retry must never find the first attempt
settled but still holding the client's place in the round."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from wafl.cli.sim.local_transport import LocalSession
from wafl.client.session import upload_header
from wafl.common.config import load_config
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import write_transfer
from wafl.server.engine import RoundEngine
from wafl.server.upload import receive_upload


async def test_cleanup_survives_a_second_cancellation_and_a_retry_is_admitted(tmp_path: Path) -> None:
    cfg = load_config(None, {"num_clients": 1, "rounds": 1, "checkpoint": False, "eval_every": 0})
    engine = RoundEngine(cfg, tmp_path)
    session = LocalSession(engine, "client-0", 0, 10)
    session.join()
    run = asyncio.create_task(engine.run())
    try:
        for _ in range(100):
            if engine.strategy.current is not None:
                break
            await asyncio.sleep(0.01)
        body = list(write_transfer(pb.UploadMessage, engine.global_state.items(), []))
        streaming = asyncio.Event()

        async def stalled(key: str):
            yield pb.UploadMessage(header=upload_header(engine.run_id, 1, "client-0", 10, key, {}))
            for m in body[:-1]:  # everything but the trailer, then the stream stalls
                yield m
            streaming.set()
            await asyncio.Event().wait()

        key = uuid.uuid4().hex
        first = asyncio.create_task(receive_upload(engine.uploads, stalled(key), session.credential))
        await streaming.wait()
        await asyncio.sleep(0.05)  # its chunks are folded
        first.cancel()  # the client cancelled the call ...
        for _ in range(5):
            await asyncio.sleep(0)
            first.cancel()  # ... and the task is cancelled again while it cleans up
        try:
            await first
        except asyncio.CancelledError:
            pass
        for _ in range(200):  # the cleanup finishes on its own
            if not engine.uploads.attempts and not engine.strategy.current.in_flight:
                break
            await asyncio.sleep(0.01)
        assert not engine.strategy.current.in_flight and not engine.uploads.attempts
        assert engine.strategy.current.accumulator.count == 0 and not engine.strategy.current.accumulator.open_folds

        async def whole(key: str):
            yield pb.UploadMessage(header=upload_header(engine.run_id, 1, "client-0", 10, key, {}))
            for m in body:
                yield m

        round_, nbytes = await receive_upload(engine.uploads, whole(key), session.credential)  # the retry, same key
        assert round_ == 1 and nbytes == engine.model_bytes
    finally:
        run.cancel()
        engine.executor.shutdown(wait=False, cancel_futures=True)
        engine.fold_workers.shutdown()

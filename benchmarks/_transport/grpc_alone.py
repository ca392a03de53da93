"""One upload's chunk messages through a bare ``grpc.aio`` stream (bytes in, bytes out): what gRPC alone
reaches, with and without an awaited thread hop per message."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import Any

from .common import MB
from .lifetime import orphan_watchdog


def _grpc_raw_server(port_q: Any, hop: bool, limit: int) -> None:
    """A bare grpc.aio server: one stream-unary method taking raw bytes (no deserializer), summing
    their lengths; with ``hop`` it also hands every message to a thread pool and awaits it (what
    one awaited thread hop per message costs)."""
    orphan_watchdog()
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    async def serve() -> None:
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        )
        pool = ThreadPoolExecutor(max_workers=4)

        async def upload(requests: Any, ctx: Any) -> bytes:
            loop = asyncio.get_running_loop()
            n = 0
            async for m in requests:
                n += len(m)
                if hop:
                    await loop.run_in_executor(pool, len, m)
            return n.to_bytes(8, "little")

        server.add_generic_rpc_handlers(
            [
                grpc.method_handlers_generic_handler(
                    "bench.Raw", {"Upload": grpc.stream_unary_rpc_method_handler(upload)}
                )
            ]
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await server.wait_for_termination()

    asyncio.run(serve())


def _grpc_raw_client(port: int, sizes: list[int], reps: int, limit: int, result_q: Any) -> None:
    orphan_watchdog()
    import grpc

    async def run() -> list[float]:
        ch = grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        call = ch.stream_unary("/bench.Raw/Upload")
        blob = os.urandom(max(sizes))
        msgs = [blob[:n] for n in sizes]

        async def gen() -> Any:
            for m in msgs:
                yield m

        times = []
        for _ in range(reps + 1):  # the first one warms the connection up
            t0 = time.monotonic()
            reply = await call(gen())
            times.append(time.monotonic() - t0)
            assert int.from_bytes(reply, "little") == sum(sizes)
        await ch.close()
        return times[1:]

    result_q.put(asyncio.run(run()))


def grpc_alone(ctx: Any, sizes: list[int], reps: int) -> dict[str, Any]:
    """The same stream of messages as one wafl upload, through bare grpc.aio (bytes in, bytes out)."""
    from wafl.server.app import MESSAGE_LIMIT

    out: dict[str, Any] = {"messages": len(sizes), "bytes": sum(sizes), "reps": reps}
    for name, hop in (("plain", False), ("executor_hop_per_message", True)):
        port_q, result_q = ctx.Queue(), ctx.Queue()
        srv = ctx.Process(
            target=_grpc_raw_server,
            args=(port_q, hop, MESSAGE_LIMIT),
            daemon=True,
            name=f"bench-grpc-raw-server-{name}",
        )
        srv.start()
        try:
            port = port_q.get(timeout=120)
            cli = ctx.Process(
                target=_grpc_raw_client,
                args=(port, sizes, reps, MESSAGE_LIMIT, result_q),
                daemon=True,
                name=f"bench-grpc-raw-client-{name}",
            )
            cli.start()
            times = result_q.get(timeout=300)
            cli.join(10)
        finally:
            srv.terminate()
            srv.join(5)
        rates = [sum(sizes) / t / MB for t in times]
        out[name] = {"MBps": [round(x, 1) for x in rates], "median_MBps": round(statistics.median(rates), 1)}
    return out


def upload_message_sizes() -> list[int]:
    """Sizes of the chunk messages of one upload of the benchmark's model (as encoded by wafl)."""
    import torch
    from wafl.common.codec import iter_chunks
    from wafl.common.models import build_model
    from wafl.common.wire import encode_upload, group_chunks

    torch.manual_seed(0)
    state = build_model("resnet18", 10, 3, 32, 32).state_dict()
    return [len(encode_upload(m)) for m in group_chunks(iter_chunks(state.items()))]

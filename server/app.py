"""Starts the gRPC server (federation, health, reflection) and drives one run to its end."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from wafl.common.codec import MAX_CHUNK_BYTES
from wafl.common.config import RunConfig
from wafl.common.proto import federation_pb2 as pb
from wafl.common.tls import ServerTls
from wafl.server.engine import RoundEngine
from wafl.server.service import SERVICE, FederationService, handlers

MESSAGE_LIMIT = MAX_CHUNK_BYTES + (64 << 10)  # one chunk plus its header; nothing larger is ever needed
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # Without BDP probing the per-stream receive windows stay small: ten concurrent uploads
    # then buffer ~1 MiB each in gRPC instead of growing windows of ~17 MB each (peak RSS
    # about 2x the model instead of up to 6x, benchmarks/results/transport.json).
    ("grpc.http2.bdp_probe", 0),
    # Large HTTP/2 frames: a 1 MiB message crosses in a few frames instead of 64 of 16 KiB.
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
]


async def serve(
    cfg: RunConfig,
    host: str,
    port: int,
    out_dir: Path,
    token: str = "",
    resume: bool = False,
    ready_file: Path | None = None,
    final_report_timeout_s: float = 30.0,
    tls: ServerTls | None = None,
) -> int:
    """Runs the federation; returns 0 on a completed run. Writes the bound port to ``ready_file``."""
    import structlog

    log = structlog.get_logger("server")
    engine = RoundEngine(cfg, out_dir, token=token, resume=resume)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers([handlers(FederationService(engine))])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls.credentials())
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("server.listening", address=f"{host}:{bound}", tls=tls is not None, run_id=engine.run_id, out=str(out_dir))
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": bound, "run_id": engine.run_id}))
        tmp.replace(ready_file)
    code = 0
    try:
        await engine.run_to_end(final_report_timeout_s)
    except Exception as e:  # a run that cannot finish is logged with its reason
        log.error("run.aborted", error=str(e))
        code = 1
    finally:
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=2.0)
        engine.executor.shutdown(wait=False, cancel_futures=True)
    return code


__all__ = ["GRPC_OPTIONS", "MESSAGE_LIMIT", "serve", "pb"]

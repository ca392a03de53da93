"""Starts the gRPC server (federation, health, reflection) and drives one run to its end."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from wafl.common.codec import MAX_CHUNK_BYTES
from wafl.common.config import ConfigError, RunConfig
from wafl.common.errors import RunAborted, UsageError
from wafl.common.proto import federation_pb2 as pb
from wafl.common.tls import ServerTls
from wafl.server.auth import JoinSecrets, check_token
from wafl.server.engine import RoundEngine
from wafl.server.limits import CLIENT_CALLS, LOBBY_SIZE, Admission, ClientCalls, Lobby
from wafl.server.service import SERVICE, FederationService, handlers
from wafl.server.strategies import check_aggregation

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
    # A client holds at most four calls at once (Join, Broadcasts, Upload, Report).
    ("grpc.max_concurrent_streams", 16),
]


def max_concurrent_rpcs(cfg: RunConfig) -> int:
    """Calls served at once before new ones get RESOURCE_EXHAUSTED: the last line of defence only.
    Admission per peer (:mod:`wafl.server.limits`) keeps every caller far below it: each client's
    own budget, the lobby of calls without a credential, and room for calls being refused."""
    return (CLIENT_CALLS + 1) * cfg.federation.num_clients + lobby_size(cfg) + 256


def lobby_size(cfg: RunConfig) -> int:
    """Calls without a credential waiting at once: every client joining at the same moment fits."""
    return LOBBY_SIZE + cfg.federation.num_clients


def grpc_options(cfg: RunConfig) -> list[tuple[str, int]]:
    """:data:`GRPC_OPTIONS` plus the limits that grow with the federation. gRPC core cancels new
    calls (CANCELLED, at random) once more than ``grpc.server.max_pending_requests`` (default
    1,000; all of them beyond the hard limit, default 3,000) have arrived and wait for the
    server to take them: every client joining at once, or every selected client uploading at
    once, is such a burst. Both limits are set to the calls the server admits at once."""
    calls = max_concurrent_rpcs(cfg)
    return GRPC_OPTIONS + [
        ("grpc.server.max_pending_requests", calls),
        ("grpc.server.max_pending_requests_hard_limit", calls),
    ]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, secrets: JoinSecrets, allow_open: bool, client_certificates: bool = False) -> None:
    """Refuses (``ConfigError``) to serve a non-loopback address that anyone may join, unless asked to
    (client certificates required by mutual TLS are a credential)."""
    if secrets.open and not client_certificates and not is_loopback(host) and not allow_open:
        raise ConfigError(
            f"--host {host} is not a loopback address and no credential is set: anyone who reaches it could join; "
            "set --token (or WAFL_TOKEN), --enrollment or --tls-client-ca, or pass --allow-open"
        )


def check_networked(cfg: RunConfig) -> None:
    """Refuses what only an in-process run can measure: the gradient dissimilarity needs every selected
    client's full gradient at the global model, a model-sized tensor the protocol does not carry."""
    if cfg.evaluation.grad_dissimilarity_every:
        raise ConfigError(
            f"grad_dissimilarity_every={cfg.evaluation.grad_dissimilarity_every} is measured in process only "
            "(wafl sweep "
            "without --network, wafl.cli.sim.simulate): over the network each client would have to send its full "
            "gradient, which the protocol does not carry; set it to 0"
        )


def check_out_dir(out_dir: Path, resume: bool) -> None:
    """A new run never writes into a folder that holds another run's record (``UsageError``); the
    folder is made private (:func:`make_private`)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is not a folder")
    if not resume:
        for name in ("results.jsonl", "checkpoint.pt"):
            if (out_dir / name).exists():
                raise UsageError(
                    f"--out {out_dir} already holds a run ({name}): "
                    "pass --resume to continue it, or choose another folder"
                )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        make_private(out_dir)
    except OSError as e:
        raise UsageError(f"--out {out_dir} cannot be created: {e.strerror}") from None


def make_private(out_dir: Path) -> None:
    """The run folder is its owner's only: the folder and those below it 0700, its files 0600, and
    what this process creates from now on too (umask 077). It holds the global model, the results
    and the salt of the credential key."""
    os.umask(0o077)
    out_dir.chmod(0o700)
    for root, dirs, files in os.walk(out_dir):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o700)
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                os.chmod(p, 0o600)


async def serve(
    cfg: RunConfig,
    host: str,
    port: int,
    out_dir: Path,
    token: str = "",
    resume: bool = False,
    ready_file: Path | None = None,
    final_report_timeout_s: float | None = None,
    tls: ServerTls | None = None,
    enrollment: dict[int, str] | None = None,
    allow_open: bool = False,
) -> int:
    """Runs the federation; returns 0 on a completed run. Writes the bound port to ``ready_file``."""
    import structlog

    log = structlog.get_logger("server")
    mutual = tls is not None and tls.client_ca is not None
    check_token(token)
    check_exposure(host, JoinSecrets(token, dict(enrollment or {})), allow_open, mutual)
    check_networked(cfg)
    check_aggregation(cfg)
    check_out_dir(out_dir, resume)
    engine = RoundEngine(cfg, out_dir, token=token, resume=resume, enrollment=enrollment)
    if engine.secrets.open and not mutual:
        log.warning("server.open", message="no --token or --enrollment: any client that reaches the server may join")
    calls = ClientCalls()
    server = grpc.aio.server(
        options=grpc_options(cfg),
        maximum_concurrent_rpcs=max_concurrent_rpcs(cfg),
        interceptors=[Admission(engine.credential_holder, lobby=Lobby(lobby_size(cfg)), clients=calls)],
    )
    server.add_generic_rpc_handlers([handlers(FederationService(engine, client_certificates=mutual, calls=calls))])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address) if tls is None else server.add_secure_port(address, tls.credentials())
    except RuntimeError:
        engine.executor.shutdown(wait=False)
        raise UsageError(f"cannot listen on {address}: the port is in use or the address is not this host's") from None
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "server.listening",
        address=f"{host}:{bound}",
        tls=tls is not None,
        mutual_tls=mutual,
        run_id=engine.run_id,
        out=str(out_dir),
    )
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"port": bound, "run_id": engine.run_id}))
        tmp.replace(ready_file)
    code = 0
    try:
        await engine.run_to_end(final_report_timeout_s)
    except Exception as e:
        # a run that cannot go on (RunAborted) has a one-line reason; any other failure keeps its traceback
        expected = isinstance(e, RunAborted)
        log.error("run.aborted", error=str(e), exc_info=not expected)
        engine.mailbox.abort(str(e) if expected else f"the server failed: {e}")
        code = 1
    finally:
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=2.0)
        engine.executor.shutdown(wait=False, cancel_futures=True)
        engine.fold_workers.shutdown()
    return code


__all__ = ["GRPC_OPTIONS", "MESSAGE_LIMIT", "serve", "pb"]

"""``wafl health``: the gRPC health check of a server (exit 0 when SERVING)."""

from __future__ import annotations

import argparse
import sys


def cmd_health(a: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from wafl.common.tls import client_tls

    tls = client_tls(a.tls_ca, a.tls_server_name, a.tls_cert, a.tls_key)
    try:
        ch = (
            grpc.insecure_channel(a.server)
            if tls is None
            else grpc.secure_channel(a.server, tls.credentials(), options=tls.options())
        )
        with ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout
            )
    except grpc.RpcError as e:
        print(f"{a.server}: {e.code().name} {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{a.server}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1

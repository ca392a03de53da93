"""TLS for the federation's gRPC connections: credentials from PEM files, checked at start.

The server presents a certificate chain and key (``--tls-cert``, ``--tls-key``); clients and
``wafl health`` verify it against a CA bundle (``--tls-ca``). ``--tls-server-name`` checks the
certificate against another name than the one dialled (an IP address, a compose service name).
Without these options every connection is plaintext, as on localhost. A missing or unreadable
file, or a certificate without its key, is a configuration error that names the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from wafl.common.config import ConfigError


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path!r} cannot be read: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {path!r} is not a PEM file")
    return data


@dataclass(frozen=True)
class ServerTls:
    cert: str
    key: str

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))])


@dataclass(frozen=True)
class ClientTls:
    ca: str
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "--tls-ca"))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def server_tls(cert: str | None, key: str | None) -> ServerTls | None:
    """``None`` for plaintext; both files or neither."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise ConfigError(
            "--tls-cert and --tls-key go together: " + ("--tls-key is missing" if cert else "--tls-cert is missing")
        )
    tls = ServerTls(cert, key)
    tls.credentials()  # read both files now: a bad path fails at start, not at the first handshake
    return tls


def client_tls(ca: str | None, server_name: str | None = None) -> ClientTls | None:
    if not ca:
        if server_name:
            raise ConfigError("--tls-server-name needs --tls-ca")
        return None
    tls = ClientTls(ca, server_name or None)
    tls.credentials()
    return tls


def channel(address: str, tls: ClientTls | None, options: list[tuple[str, object]]) -> grpc.aio.Channel:
    """An asyncio channel, secure when ``tls`` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


__all__ = ["ClientTls", "ServerTls", "channel", "client_tls", "server_tls"]

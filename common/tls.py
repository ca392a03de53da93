"""TLS for the federation's gRPC connections: credentials from PEM files, checked at start.

The server presents a certificate chain and key (``--tls-cert``, ``--tls-key``); clients and
``wafl health`` verify it against a CA bundle (``--tls-ca``). ``--tls-server-name`` checks the
certificate against another name than the one dialled (an IP address, a compose service name).
Without these options every connection is plaintext, as on localhost. A missing or unreadable
file, or a certificate without its key, is a configuration error that names the file.

Mutual TLS: a server given ``--tls-client-ca`` accepts only connections whose client presents a
certificate issued by that CA (clients pass theirs with ``--tls-cert`` and ``--tls-key``); the
server binds the certificate's identity to a client index (:func:`wafl.server.auth.certificate_index`).
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
    client_ca: str | None = None  # mutual TLS: clients must present a certificate issued by this CA

    def credentials(self) -> grpc.ServerCredentials:
        pair = [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))]
        if self.client_ca is None:
            return grpc.ssl_server_credentials(pair)
        ca = _read(self.client_ca, "--tls-client-ca")
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)


@dataclass(frozen=True)
class ClientTls:
    ca: str
    server_name: str | None = None
    cert: str | None = None  # this client's certificate chain and key, for a server that requires one
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "--tls-ca")
        if self.cert is None or self.key is None:
            return grpc.ssl_channel_credentials(root_certificates=ca)
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=_read(self.key, "--tls-key"),
            certificate_chain=_read(self.cert, "--tls-cert"),
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _pair(cert: str | None, key: str | None) -> None:
    if bool(cert) != bool(key):
        raise ConfigError(
            "--tls-cert and --tls-key go together: " + ("--tls-key is missing" if cert else "--tls-cert is missing")
        )


def server_tls(cert: str | None, key: str | None, client_ca: str | None = None) -> ServerTls | None:
    """``None`` for plaintext; both files or neither; ``client_ca`` (mutual TLS) needs both."""
    _pair(cert, key)
    if not cert or not key:
        if client_ca:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (the server's own certificate)")
        return None
    tls = ServerTls(cert, key, client_ca or None)
    tls.credentials()  # read every file now: a bad path fails at start, not at the first handshake
    return tls


def client_tls(
    ca: str | None, server_name: str | None = None, cert: str | None = None, key: str | None = None
) -> ClientTls | None:
    """``None`` for plaintext; ``cert`` and ``key`` (this client's, for mutual TLS) go together and need ``ca``."""
    _pair(cert, key)
    if not ca:
        if server_name:
            raise ConfigError("--tls-server-name needs --tls-ca")
        if cert:
            raise ConfigError("--tls-cert needs --tls-ca (the CA that verifies the server)")
        return None
    tls = ClientTls(ca, server_name or None, cert or None, key or None)
    tls.credentials()
    return tls


def channel(address: str, tls: ClientTls | None, options: list[tuple[str, object]]) -> grpc.aio.Channel:
    """An asyncio channel, secure when ``tls`` is given."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=[*options, *tls.options()])


__all__ = ["ClientTls", "ServerTls", "channel", "client_tls", "server_tls"]

"""Who may speak for whom: join secrets, and the session credential every other RPC carries.

A client proves at ``Join`` that it may join: with the run token (``--token``), or, when the
server holds per-client enrollment secrets (``--enrollment FILE``), with the secret of the index
it joins as, so that no client can take another's index. ``Join`` then hands it a session
credential, an HMAC-SHA256 over the run id, its index and its client id under a key kept in the
run folder (``server.key``, so credentials survive a server restarted with ``--resume``).
``Broadcasts``, ``Upload`` and ``Report`` carry it in the gRPC metadata entry
:data:`CREDENTIAL_KEY`; a registered index re-joins only with its credential (or its enrollment
secret). Without a credential a call is ``UNAUTHENTICATED``; with a valid credential of another
client it is ``PERMISSION_DENIED``.

Under mutual TLS (``--tls-client-ca``) the connection itself names the client too: the common
name of its certificate ends in ``client-<INDEX>`` (``client-3``, ``wafl-client-3``,
``site-a.client-3``); a Join for another index, or a session credential of another index on that
connection, is ``PERMISSION_DENIED``, and a certificate without such a name is ``UNAUTHENTICATED``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from wafl.common.config import ConfigError
from wafl.common.errors import Code, Refused

CREDENTIAL_KEY = "wafl-credential"  # gRPC metadata key of the session credential
ID_PATTERN = re.compile(r"[A-Za-z0-9._:@-]{1,64}")  # client ids
KEY_FILE = "server.key"
MAX_SECRET_CHARS = 256
CERT_NAME = re.compile(r"(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,62}[._-])?client-([0-9]{1,9})")  # certificate common names


def check_id(what: str, value: str) -> None:
    """Client ids: 1-64 characters of ``A-Z a-z 0-9 . _ : @ -``; raises :class:`Refused`."""
    if not ID_PATTERN.fullmatch(value):
        raise Refused(f"{what} must be 1-64 characters of A-Z a-z 0-9 . _ : @ - (got {len(value)} characters)")


def certificate_index(auth_context: Mapping[str, Sequence[bytes]]) -> int:
    """The client index a mutual-TLS peer's certificate names (see the module docstring); raises :class:`Refused`."""
    names = auth_context.get("x509_common_name") or []
    name = names[0].decode("utf-8", "replace") if names else ""
    m = CERT_NAME.fullmatch(name)
    if m is None:
        shown = f"{name[:64]!r}" if name else "no common name"
        raise Refused(
            f"the client certificate ({shown}) names no client: its common name must end in client-<INDEX>",
            Code.UNAUTHENTICATED,
        )
    return int(m.group(1))


def check_certificate(peer: int, index: int, what: str) -> None:
    """Raises PERMISSION_DENIED when ``index`` (of a Join or a credential) is not the certificate's ``peer``."""
    if index != peer:
        raise Refused(
            f"the client certificate is bound to client_index {peer}; {what} is {index}", Code.PERMISSION_DENIED
        )


@dataclass(frozen=True)
class JoinSecrets:
    """What a Join must present: the run token, or the enrollment secret of its index (or nothing: open)."""

    token: str = ""
    enrollment: dict[int, str] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return not self.token and not self.enrollment

    def admits(self, index: int, presented: str) -> bool:
        if self.enrollment:
            expected = self.enrollment.get(index)
            return expected is not None and hmac.compare_digest(presented.encode(), expected.encode())
        if self.token:
            return hmac.compare_digest(presented.encode(), self.token.encode())
        return True


def load_enrollment(path: str, num_clients: int) -> dict[int, str]:
    """Reads ``INDEX SECRET`` lines (``#`` comments, blank lines ignored); raises :class:`ConfigError`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--enrollment {path!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    out: dict[int, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit() or not 0 <= int(parts[0]) < num_clients:
            raise ConfigError(
                f"--enrollment {path!r} line {n}: expected 'INDEX SECRET' with INDEX in 0..{num_clients - 1}"
            )
        if not 16 <= len(parts[1]) <= MAX_SECRET_CHARS:
            raise ConfigError(f"--enrollment {path!r} line {n}: a secret must have 16 to {MAX_SECRET_CHARS} characters")
        if int(parts[0]) in out:
            raise ConfigError(f"--enrollment {path!r} line {n}: index {parts[0]} appears twice")
        out[int(parts[0])] = parts[1]
    if not out:
        raise ConfigError(f"--enrollment {path!r} holds no 'INDEX SECRET' line")
    return out


def load_or_create_key(out_dir: Path) -> bytes:
    """The run's credential key, created (mode 0600) on first use and kept in the run folder."""
    path = out_dir / KEY_FILE
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except FileNotFoundError:
        pass
    out_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    tmp = path.with_name(f"{KEY_FILE}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    os.replace(tmp, path)
    return key


class Credentials:
    """Issues and checks session credentials ``<index>.<hex HMAC-SHA256(key, run_id, index, client_id)>``."""

    def __init__(self, key: bytes, run_id: str) -> None:
        self.key = key
        self.run_id = run_id

    def _mac(self, index: int, client_id: str) -> str:
        msg = f"{self.run_id}\0{index}\0{client_id}".encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def issue(self, client_id: str, index: int) -> str:
        return f"{index}.{self._mac(index, client_id)}"

    def index_of(self, credential: str, client_id: str) -> int | None:
        """The index ``credential`` was issued to ``client_id`` for, or None when it was not."""
        head, _, mac = credential.partition(".")
        if not (head.isdigit() and len(head) <= 9 and len(mac) == 64):
            return None
        index = int(head)
        return index if hmac.compare_digest(mac, self._mac(index, client_id)) else None

    def check(self, credential: str, client_id: str, owner_of: Callable[[int], str | None]) -> int:
        """The caller's index; raises :class:`Refused` (UNAUTHENTICATED, PERMISSION_DENIED)."""
        if not credential:
            raise Refused(f"no session credential (metadata {CREDENTIAL_KEY!r}): call Join first", Code.UNAUTHENTICATED)
        index = self.index_of(credential, client_id)
        if index is not None:
            return index
        head = credential.partition(".")[0]
        owner = owner_of(int(head)) if head.isdigit() and len(head) <= 9 else None
        if owner is not None and self.index_of(credential, owner) is not None:
            raise Refused("this session credential belongs to another client", Code.PERMISSION_DENIED)
        raise Refused("invalid session credential", Code.UNAUTHENTICATED)

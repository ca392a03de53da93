"""Who may speak for whom: join secrets, and the session credential every other RPC carries.

A client proves at ``Join`` that it may join: with the run token (``--token``), or, when the
server holds per-client enrollment secrets (``--enrollment FILE``), with the secret of the index
it joins as, so that no client can take another's index. ``Join`` then hands it a session
credential, an HMAC-SHA256 over the run id, its index and its client id under a key kept in the
run folder (``server.key``) and the join secrets (so credentials survive a server restarted with
``--resume`` and its secrets, while the file alone forges nothing; :func:`load_or_create_key`).
Which client owns which index is kept in the checkpoint: after ``--resume`` an index still
belongs to its client, which re-claims it with its credential (or its enrollment secret); a bare
token never takes over an owned index.
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

import contextlib
import hashlib
import hmac
import math
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from wafl.common.config import ConfigError
from wafl.common.contract import CREDENTIAL_KEY
from wafl.common.errors import Code, Refused

log = structlog.get_logger("server")
ID_PATTERN = re.compile(r"[A-Za-z0-9._:@-]{1,64}")  # client ids
KEY_FILE = "server.key"
MIN_SECRET_CHARS = 16  # run tokens and enrollment secrets alike
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


HASH_SCHEME = "sha256"


def hash_secret(secret: str, salt: bytes | None = None) -> str:
    """``sha256:SALT:DIGEST`` (hex) of an enrollment secret, as its enrollment file keeps it.

    One salted SHA-256, not a slow password hash: the secrets are at least 16 characters, 144
    random bits when ``wafl enroll`` draws them, which no guessing reaches, and the server checks
    one at every Join, where a slow hash would give any caller a lever on its CPU."""
    salt = secrets.token_bytes(16) if salt is None else salt
    return f"{HASH_SCHEME}:{salt.hex()}:{hashlib.sha256(salt + secret.encode()).hexdigest()}"


def verify_secret(presented: str, stored: str) -> bool:
    """Whether ``presented`` is the secret whose :func:`hash_secret` is ``stored`` (constant time)."""
    _, salt, _ = stored.split(":")
    return hmac.compare_digest(hash_secret(presented, bytes.fromhex(salt)).encode(), stored.encode())


HASHED = re.compile(rf"{HASH_SCHEME}:[0-9a-f]{{32}}:[0-9a-f]{{64}}")


@dataclass(frozen=True)
class JoinSecrets:
    """What a Join must present: the run token, or the enrollment secret of its index (or nothing: open).
    ``enrollment`` holds each index's :func:`hash_secret`, never the secret."""

    token: str = ""
    enrollment: dict[int, str] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        return not self.token and not self.enrollment

    def material(self) -> bytes:
        """What the credential key is derived from besides ``server.key``: the token, or the enrollment hashes."""
        if self.enrollment:
            return "\n".join(f"{i} {h}" for i, h in sorted(self.enrollment.items())).encode()
        return self.token.encode()

    def admits(self, index: int, presented: str) -> bool:
        if self.enrollment:
            expected = self.enrollment.get(index)
            return expected is not None and verify_secret(presented, expected)
        if self.token:
            return hmac.compare_digest(presented.encode(), self.token.encode())
        return True


MIN_DISTINCT_CHARS = 8  # fewer distinct characters in a token: warned of as guessable


def weak_secret(secret: str) -> str | None:
    """Why a secret of an accepted length is still easy to guess (few distinct characters), or None."""
    distinct = len(set(secret.strip()))
    if distinct < MIN_DISTINCT_CHARS:
        return f"it has {distinct} distinct characters (fewer than {MIN_DISTINCT_CHARS}); use a random one"
    return None


def check_token(token: str) -> None:
    """A run token has the length enrollment secrets must have (whitespace apart); raises :class:`ConfigError`.
    A token of that length but few distinct characters (``aaaaaaaaaaaaaaaa``) is accepted with a warning."""
    if token and not (MIN_SECRET_CHARS <= len(token.strip()) and len(token) <= MAX_SECRET_CHARS):
        raise ConfigError(
            f"the run token (WAFL_TOKEN or --token-file) must have {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} "
            f"characters other than blanks (got {len(token.strip())}): a short one can be guessed"
        )
    why = weak_secret(token) if token else None
    if why is not None:
        log.warning("auth.weak_token", reason=f"the run token is easy to guess: {why}")


def check_private(path: str, flag: str) -> None:
    """Warns when the file at ``path`` can be read or written by its group or others."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        log.warning(
            "auth.file_not_private",
            flag=flag,
            path=path,
            mode=f"{mode:04o}",
            reason="its group or others can read it; make it the owner's only (chmod 600)",
        )


def read_index_file(
    path: str, num_clients: int, flag: str, value: str, check: Callable[[str], str | None]
) -> dict[int, str]:
    """Reads a file of ``INDEX VALUE`` lines (``#`` comments, blank lines ignored) with one line for
    every index of the run; ``check(value)`` returns why a value is refused (None: accepted). Every
    problem is a :class:`ConfigError` naming ``flag``, the file and the line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} {path!r} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    out: dict[int, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit() or not 0 <= int(parts[0]) < num_clients:
            raise ConfigError(f"{flag} {path!r} line {n}: expected 'INDEX {value}' with INDEX in 0..{num_clients - 1}")
        why = check(parts[1])
        if why is not None:
            raise ConfigError(f"{flag} {path!r} line {n}: {why}")
        if int(parts[0]) in out:
            raise ConfigError(f"{flag} {path!r} line {n}: index {parts[0]} appears twice")
        out[int(parts[0])] = parts[1]
    missing = [i for i in range(num_clients) if i not in out]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise ConfigError(
            f"{flag} {path!r} has no secret for client_index {shown}: those clients could never join, "
            f"and the run waits for all num_clients={num_clients}"
        )
    return out


def load_enrollment(path: str, num_clients: int) -> dict[int, str]:
    """Reads ``INDEX HASH`` lines, one :func:`hash_secret` for every index of the run, as
    ``wafl enroll`` writes them; raises :class:`ConfigError`."""

    def salted(value: str) -> str | None:
        if HASHED.fullmatch(value):
            return None
        return (
            f"not a salted hash ({HASH_SCHEME}:SALT:DIGEST): the file must not hold secrets in plaintext; "
            "make it with 'wafl enroll'"
        )

    check_private(path, "--enrollment")
    return read_index_file(path, num_clients, "--enrollment", "HASH", salted)


def load_or_create_key(out_dir: Path, wrap: bytes = b"") -> bytes:
    """The run's credential key: HMAC-SHA256 of ``wrap`` (the server's join secrets, see
    :meth:`JoinSecrets.material`) under a random salt created (mode 0600) on first use and kept in
    the run folder (``server.key``), so that credentials survive a restart with ``--resume`` and the
    same secrets, while the file alone, without the token or the enrollment file, forges nothing."""
    salt = _load_or_create_salt(out_dir)
    return hmac.new(salt, b"wafl-credential-key\0" + wrap, hashlib.sha256).digest()


def _load_or_create_salt(out_dir: Path) -> bytes:
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
    """Issues and checks session credentials ``<index>.<hex HMAC-SHA256(key, run_id, index, client_id[, epoch])>``.

    ``epochs`` counts, per index, the sessions that replaced an earlier one (:meth:`renew`); the MAC covers
    the index's epoch from the first replacement on, so a replaced session's credential stops working
    (epoch 0 adds nothing: the credentials of a run that never replaced a session are those of before)."""

    def __init__(self, key: bytes, run_id: str, epochs: dict[int, int] | None = None) -> None:
        self.key = key
        self.run_id = run_id
        self.epochs = {} if epochs is None else epochs  # shared with the engine, which checkpoints it

    def _mac(self, index: int, client_id: str) -> str:
        epoch = self.epochs.get(index, 0)
        msg = f"{self.run_id}\0{index}\0{client_id}" + (f"\0{epoch}" if epoch else "")
        return hmac.new(self.key, msg.encode(), hashlib.sha256).hexdigest()

    def renew(self, index: int) -> None:
        """A new session replaces the index's last one: its credential no longer passes."""
        self.epochs[index] = self.epochs.get(index, 0) + 1

    def issue(self, client_id: str, index: int) -> str:
        return f"{index}.{self._mac(index, client_id)}"

    def index_of(self, credential: str, client_id: str) -> int | None:
        """The index ``credential`` was issued to ``client_id`` for, or None when it was not."""
        head, _, mac = credential.partition(".")
        if not (head.isdigit() and len(head) <= 9 and len(mac) == 64):
            return None
        index = int(head)
        return index if hmac.compare_digest(mac, self._mac(index, client_id)) else None

    def holder(self, credential: str, owner_of: Callable[[int], str | None]) -> int:
        """The index of the registered client ``credential`` was issued to, whoever presents it;
        raises :class:`Refused` (UNAUTHENTICATED) for none or a credential of no registered client."""
        if not credential:
            raise Refused(f"no session credential (metadata {CREDENTIAL_KEY!r}): call Join first", Code.UNAUTHENTICATED)
        head = credential.partition(".")[0]
        owner = owner_of(int(head)) if head.isdigit() and len(head) <= 9 else None
        index = None if owner is None else self.index_of(credential, owner)
        if index is None:
            raise Refused("invalid session credential", Code.UNAUTHENTICATED)
        return index

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


REJOIN_GRACE_S = 10.0  # an index whose session was seen within this is live: no Join without its credential takes it


class Presence:
    """Whether each index's session is live, for a Join that cannot present its credential (a restarted
    client, or one whose Join reply was lost): live while a Broadcasts stream of it is open, or while it
    called with its credential within ``grace_s``. A session a Join has just registered is not live until
    it uses its credential (its reply may never have arrived); the owners a resumed server restored are
    live for ``grace_s`` from the start, so that they re-claim their index first."""

    def __init__(self, grace_s: float = REJOIN_GRACE_S) -> None:
        self.grace_s = grace_s
        self.streams: dict[int, int] = {}  # open Broadcasts streams per index
        self.last: dict[int, float] = {}  # monotonic time of the last call with the credential, or of its end

    def seen(self, index: int, now: float) -> None:
        self.last[index] = now

    def fresh(self, index: int) -> None:
        """A Join registered a new session for ``index``: live once it uses its credential."""
        self.last.pop(index, None)

    @contextlib.contextmanager
    def streaming(self, index: int, clock: Callable[[], float]) -> Iterator[None]:
        self.streams[index] = self.streams.get(index, 0) + 1
        self.last[index] = clock()
        try:
            yield
        finally:
            left = self.streams[index] - 1
            if left:
                self.streams[index] = left
            else:
                del self.streams[index]
            self.last[index] = clock()

    def live(self, index: int, now: float) -> bool:
        return self.streams.get(index, 0) > 0 or now - self.last.get(index, -math.inf) < self.grace_s

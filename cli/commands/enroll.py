"""``wafl enroll``: the enrollment file of a run (salted hashes only) and each client's secret.

With ``--secrets-dir`` it draws a secret per client index (``secrets.token_urlsafe(24)``: 32
characters, 192 random bits) and writes each to ``DIR/client-<INDEX>.secret``; with ``--from`` it
takes the ``INDEX SECRET`` lines of an existing file instead. Either way the enrollment file it
writes holds one ``INDEX sha256:SALT:DIGEST`` line per index and no secret; the server reads it
with ``--enrollment``, each client presents its secret with ``--token-file`` (or ``WAFL_TOKEN``).
Every file is created with mode 0600.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path
from typing import Any

from wafl.common.config import ConfigError
from wafl.common.errors import UsageError
from wafl.server.auth import MAX_SECRET_CHARS, MIN_SECRET_CHARS, hash_secret, read_index_file


def write_private(path: Path, text: str) -> None:
    """Writes ``text`` to a new file readable by its owner only (0600), replacing ``path`` atomically."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _plain_secrets(path: str, num_clients: int) -> dict[int, str]:
    def secret(value: str) -> str | None:
        if MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS:
            return None
        return f"a secret must have {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} characters"

    return read_index_file(path, num_clients, "--from", "SECRET", secret)


def cmd_enroll(a: argparse.Namespace) -> int:
    if a.clients < 1:
        raise ConfigError(f"--clients={a.clients} must be at least 1")
    if (a.secrets_dir is None) == (a.from_file is None):
        raise UsageError("pass exactly one of --secrets-dir (draw new secrets) and --from (hash existing ones)")
    if a.from_file is not None:
        chosen = _plain_secrets(a.from_file, a.clients)
    else:
        chosen = {i: secrets.token_urlsafe(24) for i in range(a.clients)}
        folder = Path(a.secrets_dir)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        for i, s in chosen.items():
            write_private(folder / f"client-{i}.secret", s + "\n")
    out = Path(a.out)
    lines = [f"{i} {hash_secret(s)}\n" for i, s in sorted(chosen.items())]
    write_private(out, "# wafl enrollment: INDEX sha256:SALT:DIGEST (salted hashes, no secret)\n" + "".join(lines))
    print(
        f"{out}: {len(lines)} salted hashes"
        + (f"; secrets in {a.secrets_dir}/client-<INDEX>.secret" if a.secrets_dir else "")
    )
    return 0


def add_enroll_parser(sub: argparse._SubParsersAction[Any]) -> None:
    e = sub.add_parser("enroll", help="make a run's enrollment file (salted hashes) and its clients' secrets")
    e.add_argument("--clients", type=int, required=True, help="num_clients of the run: one secret per index")
    e.add_argument("--out", required=True, help="the enrollment file to write (for wafl server --enrollment)")
    e.add_argument("--secrets-dir", help="draw new secrets, one file client-<INDEX>.secret each, here")
    e.add_argument("--from", dest="from_file", help="hash the 'INDEX SECRET' lines of this file instead")
    e.set_defaults(fn=cmd_enroll)

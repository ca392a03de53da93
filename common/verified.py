"""Files of tensors and plain values, checksummed, written atomically, read without unpickling code.

A file is ``MAGIC``, the SHA-256 of the payload in hex and a newline, then the payload: a
``torch.save`` of plain containers (dicts, lists, strings, numbers) and tensors. Reading checks
the magic (a foreign file), the length and the checksum (a truncated or corrupt one) before
anything is decoded, and decodes with ``torch.load(weights_only=True)``, which builds tensors and
plain values only and never runs code named in the file. The server's checkpoints and the
clients' state files are such files; each failure is one :class:`VerifiedFileError` naming the file.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch
from wafl.common.errors import UsageError

DIGEST_CHARS = 64  # SHA-256 in hex


class VerifiedFileError(UsageError):
    """A file that cannot be used; the message names it."""


def save_verified(path: Path, payload: Any, magic: bytes) -> None:
    """Writes to a temporary file (0600) in the same folder, fsyncs, then renames over ``path``."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(magic + hashlib.sha256(data).hexdigest().encode() + b"\n")
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_verified(path: Path, magic: bytes, what: str) -> Any | None:
    """The payload at ``path`` (None when there is no file); raises :class:`VerifiedFileError`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise VerifiedFileError(f"{what} {path}: cannot be read ({e.strerror})") from None
    head = len(magic) + DIGEST_CHARS + 1
    if not data.startswith(magic):
        raise VerifiedFileError(f"{what} {path}: not a wafl {what} (no {magic.strip().decode()} header)")
    if len(data) < head or data[head - 1 : head] != b"\n":
        raise VerifiedFileError(f"{what} {path}: truncated header")
    payload = data[head:]
    if hashlib.sha256(payload).hexdigest().encode() != data[len(magic) : head - 1]:
        raise VerifiedFileError(f"{what} {path}: checksum mismatch (corrupt or truncated)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # a payload that passed the checksum but is not tensors and plain values
        raise VerifiedFileError(f"{what} {path}: not tensors and plain values ({type(e).__name__})") from None

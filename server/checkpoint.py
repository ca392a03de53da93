"""Checkpoints on disk: tensors and plain values only, checksummed, written atomically.

A file is ``MAGIC``, the SHA-256 of the payload in hex and a newline, then the payload: a
``torch.save`` of plain containers (dicts, lists, strings, numbers) and tensors. Loading checks
the magic (a foreign file), the length and the checksum (a truncated or corrupt one) before
anything is decoded, and decodes with ``torch.load(weights_only=True)``, which builds tensors
and plain values only and never runs code named in the file. Every failure is one
:class:`CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch
from wafl.common.errors import UsageError

MAGIC = b"WAFL-CHECKPOINT-1\n"
DIGEST_CHARS = 64  # SHA-256 in hex
KEYS = ("round", "run_id", "config", "global_state", "server_state", "knowledge")


class CheckpointError(UsageError):
    """A checkpoint that cannot be used; the message names the file."""


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Writes to a temporary file in the same folder, fsyncs, then renames over ``path``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (None when there is none); raises :class:`CheckpointError`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot be read ({e.strerror})") from None
    head = len(MAGIC) + DIGEST_CHARS + 1
    if not data.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {path}: not a wafl checkpoint (no {MAGIC.strip().decode()} header)")
    if len(data) < head or data[head - 1 : head] != b"\n":
        raise CheckpointError(f"checkpoint {path}: truncated header")
    payload = data[head:]
    if hashlib.sha256(payload).hexdigest().encode() != data[len(MAGIC) : head - 1]:
        raise CheckpointError(f"checkpoint {path}: checksum mismatch (corrupt or truncated)")
    try:
        ck = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # a payload that passed the checksum but is not tensors and plain values
        raise CheckpointError(f"checkpoint {path}: not tensors and plain values ({type(e).__name__})") from None
    if not isinstance(ck, dict) or any(k not in ck for k in KEYS):
        raise CheckpointError(f"checkpoint {path}: missing entries (expected {', '.join(KEYS)})")
    return ck

"""Checkpoints on disk: a :mod:`wafl.common.verified` file (tensors and plain values only,
checksummed, written atomically, read without unpickling code) holding the entries of :data:`KEYS`.
Every failure is one :class:`CheckpointError` naming the file and what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wafl.common.verified import VerifiedFileError, load_verified, save_verified

MAGIC = b"WAFL-CHECKPOINT-1\n"
KEYS = ("round", "run_id", "config", "global_state", "server_state", "knowledge")


class CheckpointError(VerifiedFileError):
    """A checkpoint that cannot be used; the message names the file."""


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Writes to a temporary file in the same folder, fsyncs, then renames over ``path``."""
    save_verified(path, state, MAGIC)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (None when there is none); raises :class:`CheckpointError`."""
    try:
        ck = load_verified(path, MAGIC, "checkpoint")
    except VerifiedFileError as e:
        raise CheckpointError(str(e)) from None
    if ck is None:
        return None
    if not isinstance(ck, dict) or any(k not in ck for k in KEYS):
        raise CheckpointError(f"checkpoint {path}: missing entries (expected {', '.join(KEYS)})")
    return ck

"""Checkpoints on disk: a :mod:`wafl.common.verified` file (tensors and plain values only,
checksummed, written atomically, read without unpickling code) holding the entries of :data:`KEYS`.
Every failure is one :class:`CheckpointError` naming the file and what is wrong."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import structlog
from wafl.common.verified import VerifiedFileError, load_verified, save_verified

MAGIC = b"WAFL-CHECKPOINT-1\n"
KEYS = ("round", "run_id", "config", "global_state", "server_state", "knowledge")
TEMPORARY = re.compile(r"(?:checkpoint|round-[0-9]+)\.pt\.tmp[0-9]+")  # save_verified's, before its rename
log = structlog.get_logger("server")


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


def remove_stale_temporaries(out_dir: Path) -> list[Path]:
    """Removes the temporary files a checkpoint write killed before its rename left in ``out_dir`` and
    ``out_dir/checkpoints`` (``checkpoint.pt.tmp<pid>``, ``round-<n>.pt.tmp<pid>``), except this process's;
    returns them. A run folder is one server's, so no other process is writing them."""
    removed = []
    for folder in (out_dir, out_dir / "checkpoints"):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if TEMPORARY.fullmatch(name) and not name.endswith(f".tmp{os.getpid()}"):
                try:
                    (folder / name).unlink()
                except OSError:
                    continue
                removed.append(folder / name)
                log.info("checkpoint.stale_removed", path=str(folder / name))
    return removed

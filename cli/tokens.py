"""Where a run token (or an enrollment secret) comes from: the environment or a file, never the command line.

A command-line argument is readable by every local user (``/proc/PID/cmdline``, ``ps``), so
``--token VALUE`` is refused with that reason; ``--token-file FILE`` (its first line) or
``WAFL_TOKEN`` carry the secret instead.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from wafl.common.errors import UsageError

ENV = "WAFL_TOKEN"
ON_COMMAND_LINE = (
    "--token puts the secret on the command line, where every local user can read it (/proc/PID/cmdline, ps): "
    f"set {ENV} in the environment or pass --token-file FILE instead"
)


def add_token_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--token-file`` and the refused ``--token`` of a command; ``what`` says what the secret is."""
    p.add_argument("--token-file", default=os.environ.get("WAFL_TOKEN_FILE"), help=f"file whose first line is {what}")
    p.add_argument("--token", help=f"refused: use {ENV} or --token-file (a command line is visible to local users)")


def read_token(a: argparse.Namespace) -> str:
    """The secret of ``--token-file`` or :data:`ENV` (empty when neither); raises :class:`UsageError`."""
    if a.token is not None:
        raise UsageError(ON_COMMAND_LINE)
    if a.token_file:
        try:
            lines = Path(a.token_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise UsageError(f"--token-file {a.token_file!r} cannot be read: {why}") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise UsageError(f"--token-file {a.token_file!r} is empty")
        return token
    return os.environ.get(ENV, "")

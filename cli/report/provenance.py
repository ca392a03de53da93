"""What a measurement records about the code it measured."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The commit of the code being measured (recorded in every benchmark's JSON), None outside a clone."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None

"""The program's name, the error it reports with a message and an exit code, and those codes."""

from __future__ import annotations

PROG = "wafl-entrypoint"
EXIT_NO_INDEX = 2
EXIT_LINK_UNAVAILABLE = 77  # as `python -m wafl.cli.launch.netns shape`


class EntrypointError(Exception):
    """A condition the entrypoint reports with a message and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code

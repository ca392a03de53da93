"""Reading the wafl command line (subcommand, option values) and the environment (the server a client dials)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

DEFAULT_PORT = 50051
TRUE = ("1", "true", "yes", "on")


def split_command(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Returns (wafl subcommand, wafl arguments); a leading ``wafl`` is dropped."""
    args = list(argv)
    if args and args[0] == "wafl":
        args = args[1:]
    command = next((a for a in args if not a.startswith("-")), None)
    return command, args


def option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``args`` (the last one wins)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def server_address(args: Sequence[str], env: Mapping[str, str]) -> str:
    """The server a client dials: ``--server``, else ``WAFL_SERVER``, else 127.0.0.1 at ``WAFL_PORT``."""
    return (
        option(args, "--server")
        or env.get("WAFL_SERVER", "").strip()
        or f"127.0.0.1:{env.get('WAFL_PORT') or DEFAULT_PORT}"
    )

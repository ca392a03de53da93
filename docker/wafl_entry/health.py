"""The container health check: what it probes (a server itself, a client its server), the role file the
entrypoint writes for it, and the ``wafl health`` command it runs."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence

from .args import DEFAULT_PORT, option, server_address
from .errors import PROG

ROLE_FILE = "/tmp/wafl-role.json"


def health_target(command: str | None, args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """HOST:PORT the health check probes: a server itself, a client its server; else None."""
    if command == "server":
        host = option(args, "--host") or env.get("WAFL_HOST") or "0.0.0.0"
        port = option(args, "--port") or env.get("WAFL_PORT") or str(DEFAULT_PORT)
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{port}"
    if command == "client":
        return server_address(args, env)
    return None


def health_argv(env: Mapping[str, str]) -> list[str] | None:
    """The ``wafl health`` command of the health check, or None when there is nothing to probe."""
    path = env.get("WAFL_ROLE_FILE") or ROLE_FILE
    try:
        with open(path) as f:
            role = json.load(f)
        target = role.get("health")
    except (OSError, ValueError):  # not written yet: the image's main use, a server
        target = f"127.0.0.1:{env.get('WAFL_PORT') or DEFAULT_PORT}"
    if not target:
        return None
    timeout = env.get("WAFL_HEALTH_TIMEOUT") or "3"
    return [sys.executable, "-m", "wafl.cli.main", "health", "--server", target, "--timeout", timeout]


def write_role(p: dict, env: Mapping[str, str]) -> None:
    path = env.get("WAFL_ROLE_FILE") or ROLE_FILE
    try:
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"command": p["command"], "health": p["health"]}, f)
        os.replace(tmp, path)
    except OSError as e:
        print(f"{PROG}: warning: cannot write {path} for the health check: {e}", file=sys.stderr)

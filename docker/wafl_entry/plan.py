"""Everything the entrypoint will do for a command, computed without side effects (``--dry-run`` prints it)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence

from .args import TRUE, option, server_address, split_command
from .health import health_target
from .index import candidate_names, derive_index
from .shaping import shape_command


def plan(
    argv: Sequence[str],
    env: Mapping[str, str],
    names: Callable[[Mapping[str, str]], Iterator[tuple[str, str | None]]] = candidate_names,
) -> dict:
    """Everything the entrypoint will do for ``argv``, computed without side effects."""
    command, args = split_command(argv)
    args += shlex.split(env.get("WAFL_ARGS", ""))
    new_env: dict[str, str] = {}
    notes: list[str] = []
    index = None
    if command == "client" and option(args, "--server") is None and not env.get("WAFL_SERVER", "").strip():
        new_env["WAFL_SERVER"] = server_address(args, env)
    if command == "client" and option(args, "--index") is None:
        index, source = derive_index(env, names, server_address(args, {**env, **new_env}))
        new_env["WAFL_CLIENT_INDEX"] = str(index)
        notes.append(f"client index {index} from {source}")
    rate = env.get("WAFL_LINK_RATE", "").strip()
    if command == "server" and env.get("WAFL_SERVER_LINK_RATE", "").strip():
        rate = env["WAFL_SERVER_LINK_RATE"].strip()  # e.g. the clients' sum, as `wafl run --link-rate` gives it
    dev = env.get("WAFL_LINK_DEV", "").strip() or "eth0"
    shape = None
    needs_root = False
    if rate and command in ("server", "client"):
        shape = {"rate": rate, "dev": dev, "cmd": shape_command(rate, dev)}
    elif rate and command in ("bench", "run"):
        if option(args, "--link-rate") is None:
            args += ["--link-rate", rate]
        needs_root = True
        notes.append(
            f"{command}: links shaped to {rate} in network namespaces (needs root with CAP_SYS_ADMIN and CAP_NET_ADMIN)"
        )
    elif rate:
        notes.append(f"WAFL_LINK_RATE ignored for {command!r}")
    run_as = env.get("WAFL_RUN_AS", "wafl").strip()
    if needs_root or run_as in ("", "root", "0"):
        run_as = ""
    return {
        "command": command,
        "argv": [sys.executable, "-m", "wafl.cli.main", *args],
        "env": new_env,
        "index": index,
        "shape": shape,
        "link_optional": env.get("WAFL_LINK_OPTIONAL", "").strip().lower() in TRUE,
        "host_network": env.get("WAFL_HOST_NETWORK", "").strip().lower() in TRUE,
        "run_as": run_as,
        "health": health_target(command, args, {**env, **new_env}),
        "notes": notes,
    }

"""The entrypoint's modes: run a wafl command (index, shaping, privilege drop, role file, exec), ``--dry-run``,
``--print-index`` and ``--health``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from .errors import PROG, EntrypointError
from .health import health_argv, write_role
from .index import derive_index
from .plan import plan
from .privileges import drop_privileges
from .shaping import apply_shaping, has_net_admin, shape_command


def _run(cmd: list[str]) -> int:
    return subprocess.run(cmd).returncode


def main(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    execve: Callable[[str, list[str], dict[str, str]], object] = os.execve,
    run: Callable[[list[str]], int] = _run,
    net_admin: Callable[[], bool] = has_net_admin,
) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ if environ is None else environ)
    try:
        if argv[:1] == ["--health"]:
            cmd = health_argv(env)
            if cmd is None:
                print(f"{PROG}: nothing to probe for this container's command")
                return 0
            try:
                execve(cmd[0], cmd, env)
            except OSError as e:
                raise EntrypointError(f"cannot start {shlex.join(cmd)}: {e}", 127) from None
            return 0
        if argv[:1] == ["--print-index"]:
            index, source = derive_index(env)  # a claim is released when this process exits
            print(index)
            print(f"{PROG}: client index {index} from {source}", file=sys.stderr)
            return 0
        dry_run = argv[:1] == ["--dry-run"]
        if dry_run:
            argv = argv[1:]
        p = plan(argv, env)
        if dry_run:
            out = dict(p, net_admin=net_admin(), euid=os.geteuid())
            if p["shape"]:  # the tc command the CLI builds, printed by the CLI itself
                shown = subprocess.run(
                    shape_command(p["shape"]["rate"], p["shape"]["dev"], dry_run=True), capture_output=True, text=True
                )
                if shown.returncode != 0:
                    raise EntrypointError(
                        f"WAFL_LINK_RATE={p['shape']['rate']!r} rejected: {shown.stderr.strip()}", shown.returncode
                    )
                out["shape"] = dict(p["shape"], tc=shown.stdout.strip())
            print(json.dumps(out, indent=2))
            return 0
        for note in p["notes"]:
            print(f"{PROG}: {note}", file=sys.stderr)
        apply_shaping(p, net_admin(), run)
        env.update(p["env"])
        note = drop_privileges(p["run_as"], env)
        if note:
            print(f"{PROG}: {note}", file=sys.stderr)
        write_role(p, env)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            execve(p["argv"][0], p["argv"], env)
        except OSError as e:
            raise EntrypointError(f"cannot start {shlex.join(p['argv'])}: {e}", 127) from None
        return 0
    except EntrypointError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code

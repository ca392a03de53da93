"""Shaping the container's link: whether the process has CAP_NET_ADMIN, the CLI's own ``wafl.cli.launch.netns shape``
command, and running it for a plan (or saying why it cannot)."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable

from .errors import EXIT_LINK_UNAVAILABLE, PROG, EntrypointError

NET_ADMIN_BIT = 12  # CAP_NET_ADMIN, linux/capability.h


def has_net_admin(status_text: str | None = None) -> bool:
    """Whether CAP_NET_ADMIN is in this process's effective set (/proc/self/status ``CapEff``)."""
    if status_text is None:
        try:
            with open("/proc/self/status") as f:
                status_text = f.read()
        except OSError:
            return False
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)\s*$", status_text, re.MULTILINE)
    return bool(m) and bool(int(m.group(1), 16) >> NET_ADMIN_BIT & 1)


def shape_command(rate: str, dev: str, dry_run: bool = False) -> list[str]:
    """The command that puts the tbf qdisc on ``dev``: the CLI's own ``wafl.cli.launch.netns shape``."""
    cmd = [sys.executable, "-m", "wafl.cli.launch.netns", "shape", "--dev", dev, "--rate", rate]
    return [*cmd, "--dry-run"] if dry_run else cmd


def apply_shaping(p: dict, net_admin: bool, run: Callable[[list[str]], int]) -> None:
    """Runs the shaping command of plan ``p``; raises :class:`EntrypointError` (77) when it cannot."""
    if not p["shape"]:
        return
    rate, dev, cmd = p["shape"]["rate"], p["shape"]["dev"], p["shape"]["cmd"]
    problem = None
    if p.get("host_network"):
        problem = (
            f"WAFL_LINK_RATE={rate}: this container shares the host's network (WAFL_HOST_NETWORK=1, "
            f"network_mode: host), so {dev} here is the host's own interface and is left alone; shaped links "
            "run in network namespaces of their own: the bench service with docker/compose.shaped.yml, or "
            "`wafl run --link-rate` through the bench service of that override"
        )
    elif not net_admin:
        problem = (
            f"WAFL_LINK_RATE={rate} needs CAP_NET_ADMIN to shape {dev}, and this container has not got it: "
            "start it as root with `cap_add: [NET_ADMIN]` (docker/compose.shaped.yml; docker run --user 0 "
            "--cap-add NET_ADMIN); the entrypoint drops to the wafl user after shaping"
        )
    else:
        code = run(cmd)
        if code == EXIT_LINK_UNAVAILABLE:
            problem = f"link shaping of {dev} to {rate} is not available here (see the message above)"
        elif code != 0:
            raise EntrypointError(f"link shaping of {dev} to {rate} failed (exit {code}): {shlex.join(cmd)}", code)
    if problem is None:
        return
    if p["link_optional"]:
        print(
            f"{PROG}: warning: {problem}; WAFL_LINK_OPTIONAL is set, continuing with an unshaped link",
            file=sys.stderr,
            flush=True,
        )
        return
    raise EntrypointError(f"{problem} (set WAFL_LINK_OPTIONAL=1 to run unshaped instead)", EXIT_LINK_UNAVAILABLE)

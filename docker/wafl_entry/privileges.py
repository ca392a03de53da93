"""The drop from root (needed to shape the link) to the unprivileged user before the CLI starts."""

from __future__ import annotations

import os
import pwd


def drop_privileges(user: str, env: dict[str, str]) -> str | None:
    """As root, becomes ``user``; returns a note when it stays as it is."""
    if not user or os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return f"user {user!r} does not exist here; staying uid 0"
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)
    env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    return None

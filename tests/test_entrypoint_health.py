"""The entrypoint's health check (``--health``): a probe of a closed port fails naming it, the server
default applies before a role file is written, and a command with nothing to probe is healthy."""

from __future__ import annotations

import json
from pathlib import Path

from support.docker_helpers import clean_env, free_port, run_entrypoint


def test_health_probe_closed_port(tmp_path: Path) -> None:
    port = free_port()
    role = tmp_path / "role.json"
    role.write_text(json.dumps({"command": "client", "health": f"127.0.0.1:{port}"}))
    proc = run_entrypoint("--health", env=clean_env(WAFL_ROLE_FILE=str(role), WAFL_HEALTH_TIMEOUT="2"))
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr and "UNAVAILABLE" in proc.stderr
    # no role file yet: the server default, WAFL_PORT
    proc = run_entrypoint(
        "--health",
        env=clean_env(WAFL_ROLE_FILE=str(tmp_path / "missing.json"), WAFL_PORT=str(port), WAFL_HEALTH_TIMEOUT="2"),
    )
    assert proc.returncode != 0 and f"127.0.0.1:{port}" in proc.stderr


def test_health_probe_nothing_to_probe(tmp_path: Path) -> None:
    role = tmp_path / "role.json"
    role.write_text(json.dumps({"command": "bench", "health": None}))
    proc = run_entrypoint("--health", env=clean_env(WAFL_ROLE_FILE=str(role)))
    assert proc.returncode == 0 and "nothing to probe" in proc.stdout

"""What the tests of docker/ share: the files' paths, the entrypoint script run as a process, the compose
files resolved as docker-compose resolves them, and the Dockerfile's instructions.

The entrypoint's package (docker/wafl_entry/) is importable in the tests as ``wafl_entry``: pytest's
``pythonpath`` (pyproject.toml) holds docker/, as the script's own folder is on its path."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
SHAPED = DOCKER / "compose.shaped.yml"
GPU = DOCKER / "compose.gpu.yml"
TLS = DOCKER / "compose.tls.yml"
DOCKERFILE = DOCKER / "Dockerfile"
IGNORE = DOCKER / "Dockerfile.dockerignore"
ENTRYPOINT = DOCKER / "entrypoint.py"


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without WAFL_* variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAFL_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_entrypoint(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ENTRYPOINT), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_YAML_TO_JSON = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"


@functools.cache
def _compose_cli() -> tuple[tuple[str, ...], int] | None:
    """The compose command and its major version (1: Python docker-compose, 2: the Go one)."""
    candidates = []
    if shutil.which("docker-compose"):
        candidates.append((shutil.which("docker-compose") or "docker-compose",))
    if shutil.which("docker"):
        candidates.append(("docker", "compose"))
    for cli in candidates:
        probe = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True, timeout=60)
        m = re.match(r"v?(\d+)\.", probe.stdout.strip())
        if probe.returncode == 0 and m:
            return cli, int(m.group(1))
    return None


def _yaml_converters(program: str) -> Iterator[list[str]]:
    """Interpreters with PyYAML: this one, then the one docker-compose (v1, Python) runs on."""
    try:
        import yaml  # noqa: F401

        yield [sys.executable, "-c", _YAML_TO_JSON]
    except ImportError:
        pass
    first = Path(program)
    try:
        shebang = first.read_bytes()[:200].split(b"\n", 1)[0].decode()
    except (OSError, UnicodeDecodeError):
        return
    if shebang.startswith("#!") and "python" in shebang:
        yield [*shlex.split(shebang[2:]), "-c", _YAML_TO_JSON]


_INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _INTERP.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    return value


def compose_config(
    files: list[Path], env: dict[str, str] | None = None, profiles: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The resolved compose configuration of ``files``, as docker-compose sees it."""
    return json.loads(_compose_config(tuple(files), tuple(sorted((env or {}).items())), profiles))


@functools.cache
def _compose_config(files: tuple[Path, ...], env_items: tuple[tuple[str, str], ...], profiles: tuple[str, ...]) -> str:
    env = {**clean_env(), **dict(env_items)}
    found = _compose_cli()
    if found is None:
        try:
            import yaml
        except ImportError:
            pytest.skip(
                "neither docker-compose (Debian package docker-compose) nor PyYAML is available "
                "to read the compose files"
            )
        if len(files) != 1:
            pytest.skip("merging compose override files needs docker-compose")
        raw = yaml.safe_load(files[0].read_text())
        return json.dumps(_interpolate({k: v for k, v in raw.items() if not k.startswith("x-")}, env))
    cli, major = found
    cmd = [*cli, "--project-directory", str(DOCKER)]
    for f in files:
        cmd += ["-f", str(f)]
    for p in profiles:
        cmd += ["--profile", p]
    cmd.append("config")
    if major >= 2:
        cmd += ["--format", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, f"{shlex.join(cmd)} failed:\n{proc.stderr}"
    if major >= 2:
        return proc.stdout
    for conv in _yaml_converters(cli[0]):
        out = subprocess.run(conv, input=proc.stdout, capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return out.stdout
    pytest.skip(f"{shlex.join(cmd)} validated the file, but no PyYAML is available to read its output")


def service_environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def service_mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> source, for the short (``src:dst[:mode]``) and long volume syntax."""
    out = {}
    for v in service.get("volumes") or []:
        if isinstance(v, dict):
            out[v["target"]] = str(v.get("source", ""))
        else:
            parts = v.split(":")
            out[parts[1]] = parts[0]
    return out


def service_replicas(service: dict[str, Any]) -> int:
    return int((service.get("deploy") or {}).get("replicas", service.get("scale", 1)))


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

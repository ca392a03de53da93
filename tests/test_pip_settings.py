"""scripts/pip-settings.py: the build machine's pip settings (as pip reads them) rewritten for a docker build,
and the local folders they name served read-only on loopback (docker/local-engine.sh runs it)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PIP_SETTINGS = REPO / "scripts" / "pip-settings.py"


def _load_pip_settings() -> Any:
    spec = importlib.util.spec_from_file_location("wafl_docker_pip_settings", PIP_SETTINGS)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pip_settings = _load_pip_settings()


def test_pip_settings_as_pip_reads_them(tmp_path: Path) -> None:
    """Files in pip's order (global, user, PIP_CONFIG_FILE), then PIP_* variables over all of them."""
    (tmp_path / "xdg" / "pip").mkdir(parents=True)
    (tmp_path / "xdg" / "pip" / "pip.conf").write_text("[global]\ntimeout = 10\nindex-url = https://a/simple\n")
    (tmp_path / "home" / ".config" / "pip").mkdir(parents=True)
    (tmp_path / "home" / ".config" / "pip" / "pip.conf").write_text(
        "[global]\ntimeout = 20\n[install]\nfind-links = /x\nno_binary = :none:\n"
    )
    env = {"XDG_CONFIG_DIRS": str(tmp_path / "xdg"), "PIP_FIND_LINKS": "/y", "PIP_DEFAULT_TIMEOUT": "5"}
    files = pip_settings.config_files(env, tmp_path / "home")
    assert files[0] == tmp_path / "xdg" / "pip" / "pip.conf" and files[-1].is_relative_to(tmp_path / "home")
    settings = pip_settings.load_settings(env, [f for f in files if f.is_relative_to(tmp_path)])
    assert settings == {
        "global": {"timeout": "20", "index-url": "https://a/simple", "find-links": "/y", "default-timeout": "5"},
        "install": {"no-binary": ":none:"},
    }
    assert pip_settings.config_files({**env, "PIP_CONFIG_FILE": os.devnull}, tmp_path) == []
    assert pip_settings.config_files({**env, "PIP_CONFIG_FILE": "/z.conf"}, tmp_path)[-1] == Path("/z.conf")


def test_pip_settings_rewritten_for_a_build(tmp_path: Path) -> None:
    """Local folders and files become loopback URLs, the CA bundle the secret's path; the rest stays or goes."""
    (tmp_path / "index" / "simple").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "constraints.txt").write_text("torch<=9\n")
    (tmp_path / "ca.pem").write_text("CA\n")
    settings = {
        "global": {
            "index-url": "https://pypi.example/simple",
            "extra-index-url": f"file://{tmp_path}/index/simple {tmp_path}/missing",
            "find-links": f"{tmp_path}/wheels https://wheels.example/",
            "constraint": str(tmp_path / "constraints.txt"),
            "cert": str(tmp_path / "ca.pem"),
            "cache-dir": "/var/cache/pip",
            "user": "true",
            "timeout": "60",
        }
    }
    rewriter = pip_settings.Rewriter("http://127.0.0.1:8080", tmp_path)
    out = rewriter.rewrite(settings)["global"]
    assert out == {
        "index-url": "https://pypi.example/simple",
        "extra-index-url": "http://127.0.0.1:8080/0/simple/",  # the index's parent: its pages link ../../files
        "find-links": "http://127.0.0.1:8080/1/ https://wheels.example/",
        "constraint": "http://127.0.0.1:8080/2/constraints.txt",
        "cert": "/run/secrets/pip-cert",
        "timeout": "60",
    }
    assert rewriter.served == {"0": tmp_path / "index", "1": tmp_path / "wheels", "2": tmp_path / "constraints.txt"}
    assert rewriter.cert == tmp_path / "ca.pem"
    assert any("missing does not exist" in n for n in rewriter.notes) and any("cache-dir" in n for n in rewriter.notes)


def test_pip_settings_served_on_loopback(tmp_path: Path) -> None:
    """`serve`: pip.conf and the CA bundle written, the folders served read-only, nothing outside them."""
    import urllib.request

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "demo-1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    (tmp_path / "secret.txt").write_text("not served\n")
    (tmp_path / "ca.pem").write_text("CA\n")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "WAFL_"))}
    env.update(HOME=str(tmp_path), XDG_CONFIG_DIRS=str(tmp_path / "none"), PYTHONUNBUFFERED="1")
    env.update(PIP_FIND_LINKS=str(wheels), PIP_CERT=str(tmp_path / "ca.pem"))
    server = subprocess.Popen([sys.executable, str(PIP_SETTINGS), "serve", str(out)], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (out / "ready").exists():
            assert server.poll() is None and time.monotonic() < deadline, server.stderr and server.stderr.read()
            time.sleep(0.05)
        port = int((out / "ready").read_text())
        conf = (out / "pip.conf").read_text()
        assert f"find-links = http://127.0.0.1:{port}/" in conf and "cert = /run/secrets/pip-cert" in conf
        assert (out / "pip-cert").read_text() == "CA\n"
        url = re.search(r"find-links = (\S+)", conf)
        assert url
        listing = urllib.request.urlopen(url.group(1), timeout=10).read().decode()
        assert "demo-1.0-py3-none-any.whl" in listing
        assert urllib.request.urlopen(url.group(1) + "demo-1.0-py3-none-any.whl", timeout=10).read() == b"wheel bytes"
        for outside in (
            url.group(1) + "../secret.txt",
            url.group(1) + "%2e%2e/secret.txt",
            f"http://127.0.0.1:{port}/9/",
        ):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(outside, timeout=10)
            assert info.value.code == 404
        with pytest.raises(urllib.error.HTTPError):  # read-only
            urllib.request.urlopen(urllib.request.Request(url.group(1), data=b"x", method="PUT"), timeout=10)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0

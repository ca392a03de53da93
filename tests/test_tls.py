"""TLS: a federation over an encrypted, verified connection; refusals without the right CA."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from independent_client import ServerProcess
from wafl.common.config import ConfigError
from wafl.common.tls import client_tls, server_tls

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl command to make test certificates"
)


def make_cert(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 (it is its own CA)."""
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={name}",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def wafl(*args: str, timeout: float = 120.0, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "wafl.cli.main", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_federation_over_tls_and_refusals(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path / "pki", "wafl-server")
    other, _ = make_cert(tmp_path / "pki", "someone-else")
    config = {
        "dataset": "digits",
        "num_clients": 1,
        "rounds": 2,
        "local_epochs": 1,
        "eval_every": 1,
        "checkpoint": False,
        "join_timeout_s": 120,
    }
    server = ServerProcess(config, tmp_path / "server", extra_args=["--tls-cert", str(cert), "--tls-key", str(key)])
    try:
        ok = wafl("health", "--server", f"localhost:{server.port}", "--tls-ca", str(cert))
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        by_ip = wafl("health", "--server", server.address, "--tls-ca", str(cert))  # the IP is in the certificate too
        assert by_ip.returncode == 0, by_ip.stderr
        plaintext = wafl("health", "--server", server.address)
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stderr
        untrusted = wafl("health", "--server", server.address, "--tls-ca", str(other))
        assert untrusted.returncode == 1 and "UNAVAILABLE" in untrusted.stderr
        wrong_name = wafl(
            "health", "--server", server.address, "--tls-ca", str(cert), "--tls-server-name", "elsewhere.example"
        )
        assert wrong_name.returncode == 1
        from_env = wafl(
            "health", "--server", server.address, WAFL_TLS_CA=str(cert), WAFL_TLS_SERVER_NAME="localhost"
        )  # as in a container
        assert from_env.returncode == 0, from_env.stderr

        client = wafl(
            "client",
            "--server",
            f"localhost:{server.port}",
            "--index",
            "0",
            "--tls-ca",
            str(cert),
            "--quiet",
            timeout=300,
        )
        assert client.returncode == 0, client.stderr[-2000:]
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
        rows = [json.loads(line) for line in (server.out_dir / "results.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2]
        assert rows[-1]["gm_accuracy"] > 0.3  # 10 classes: well above chance after two rounds
    finally:
        server.stop()


def test_tls_options_are_checked_at_start(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "wafl-server")
    assert server_tls(None, None) is None and client_tls(None) is None
    assert server_tls(str(cert), str(key)) is not None
    with pytest.raises(ConfigError, match="--tls-key is missing"):
        server_tls(str(cert), None)
    with pytest.raises(ConfigError, match="--tls-cert is missing"):
        server_tls(None, str(key))
    with pytest.raises(ConfigError, match="no-such.pem"):
        client_tls(str(tmp_path / "no-such.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a PEM file"):
        client_tls(str(tmp_path / "junk.pem"))
    with pytest.raises(ConfigError, match="--tls-server-name needs --tls-ca"):
        client_tls(None, "example.org")
    bad = wafl("server", "--tls-cert", str(cert), "--port", "0", "--out", str(tmp_path / "out"))
    assert bad.returncode == 2 and "--tls-key is missing" in bad.stderr

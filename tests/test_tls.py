"""TLS: a federation over an encrypted, verified connection; refusals without the right CA."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from independent_client import IndependentClient, ServerProcess, call_error, expect_status, generate_stubs
from wafl.common.config import ConfigError
from wafl.common.tls import client_tls, server_tls
from wafl.server.app import check_exposure
from wafl.server.auth import JoinSecrets

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


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
        "-keyout", str(key), "-out", str(cert),
    )  # fmt: skip
    return cert, key


def issue_cert(ca: tuple[Path, Path], folder: Path, common_name: str) -> tuple[Path, Path]:
    """A client certificate with ``common_name``, issued by ``ca``."""
    cert, key, csr = folder / f"{common_name}.pem", folder / f"{common_name}.key", folder / f"{common_name}.csr"
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={common_name}", "-keyout", str(key), "-out", str(csr)
    )
    openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
        "-days", "2", "-out", str(cert),
    )  # fmt: skip
    return cert, key


def channel_credentials(
    server_cert: Path, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    if cert is None or key is None:
        return grpc.ssl_channel_credentials(root_certificates=server_cert.read_bytes())
    return grpc.ssl_channel_credentials(server_cert.read_bytes(), key.read_bytes(), cert.read_bytes())


MTLS_CONFIG = {
    "dataset": "digits",
    "num_clients": 2,
    "rounds": 2,
    "local_epochs": 1,
    "eval_every": 1,
    "checkpoint": False,
    "join_timeout_s": 120,
}


def test_mutual_tls_binds_each_certificate_to_its_client_index(tmp_path: Path) -> None:
    """--tls-client-ca: no certificate, or one from another CA, is refused at the handshake; a certificate
    that names no client is UNAUTHENTICATED; a Join, or a session credential, for another index than the
    certificate's is PERMISSION_DENIED; the right pairs join and stream."""
    pki = tmp_path / "pki"
    server_cert, server_key = make_cert(pki, "wafl-server")
    ca = make_ca(pki, "clients-ca")
    certs = [issue_cert(ca, pki, f"wafl-client-{i}") for i in range(2)]
    nameless = issue_cert(ca, pki, "someone")
    stranger = make_cert(pki / "other", "client-0")  # self-signed: not issued by the clients' CA
    pb, pb_grpc = generate_stubs(tmp_path / "stubs")
    server = ServerProcess(
        MTLS_CONFIG,
        tmp_path / "server",
        extra_args=["--tls-cert", str(server_cert), "--tls-key", str(server_key), "--tls-client-ca", str(ca[0])],
    )
    clients: list[IndependentClient] = []

    def client(name: str, index: int, pair: tuple[Path, Path] | None) -> IndependentClient:
        c = IndependentClient(
            pb, pb_grpc, server.address, name, index, 10, tls=channel_credentials(server_cert, *(pair or (None, None)))
        )
        clients.append(c)
        return c

    try:
        for pair in (None, stranger):
            err = call_error(lambda p=pair: client("x", 0, p).join(timeout=10))
            expect_status(err, grpc.StatusCode.UNAVAILABLE)
        expect_status(call_error(lambda: client("x", 0, nameless).join()), grpc.StatusCode.UNAUTHENTICATED, "client-")
        err = call_error(lambda: client("c0", 1, certs[0]).join(num_samples=0))
        expect_status(err, grpc.StatusCode.PERMISSION_DENIED, "client_index 0", "is 1")
        c0, c1 = client("c0", 0, certs[0]), client("c1", 1, certs[1])
        c0.join_and_listen()
        c1.join()
        assert c0.credential.startswith("0.") and c1.credential.startswith("1.")
        thief = client("c0", 0, certs[1])  # client 1's connection presenting client 0's credential
        thief.credential = c0.credential
        thief.reply = c0.reply
        for call in (lambda: next(iter(thief.broadcasts())), lambda: thief.report(round=1)):
            expect_status(call_error(call), grpc.StatusCode.PERMISSION_DENIED, "bound to client_index 1")
        err = call_error(lambda: thief.upload([pb.UploadMessage(header=thief.header(1, "k"))]))
        expect_status(err, grpc.StatusCode.PERMISSION_DENIED, "bound to client_index 1")
        assert server.alive(), server.log_tail()
        no_cert = wafl("health", "--server", server.address, "--tls-ca", str(server_cert))
        assert no_cert.returncode == 1 and "UNAVAILABLE" in no_cert.stderr
        ok = wafl(
            "health", "--server", server.address, "--tls-ca", str(server_cert),
            "--tls-cert", str(certs[0][0]), "--tls-key", str(certs[0][1]),
        )  # fmt: skip
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_federation_over_mutual_tls(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    server_cert, server_key = make_cert(pki, "wafl-server")
    ca = make_ca(pki, "clients-ca")
    server = ServerProcess(
        MTLS_CONFIG,
        tmp_path / "server",
        extra_args=["--tls-cert", str(server_cert), "--tls-key", str(server_key), "--tls-client-ca", str(ca[0])],
    )
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs = []
        for i in range(2):
            cert, key = issue_cert(ca, pki, f"client-{i}")
            cmd = ["client", "--server", server.address, "--index", str(i), "--tls-ca", str(server_cert), "--quiet"]
            cmd += ["--tls-cert", str(cert), "--tls-key", str(key)]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "wafl.cli.main", *cmd], stderr=subprocess.PIPE, text=True, env=env
                )
            )
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-2000:]
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
        rows = [json.loads(line) for line in (server.out_dir / "results.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [1, 2] and rows[-1]["gm_accuracy"] > 0.3
    finally:
        server.stop()


def test_mutual_tls_options_are_checked_at_start(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "wafl-server")
    with pytest.raises(ConfigError, match="--tls-client-ca needs --tls-cert"):
        server_tls(None, None, str(cert))
    with pytest.raises(ConfigError, match="--tls-client-ca"):
        server_tls(str(cert), str(key), str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="--tls-cert needs --tls-ca"):
        client_tls(None, None, str(cert), str(key))
    with pytest.raises(ConfigError, match="--tls-key is missing"):
        client_tls(str(cert), None, str(cert), None)
    assert client_tls(str(cert), None, str(cert), str(key)) is not None
    with pytest.raises(ConfigError, match="--tls-client-ca"):  # a non-loopback address needs a credential
        check_exposure("10.1.2.3", JoinSecrets(), allow_open=False)
    check_exposure("10.1.2.3", JoinSecrets(), allow_open=False, client_certificates=True)  # certificates are one

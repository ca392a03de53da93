"""Join secrets and session credentials: the pieces, per-client enrollment over the wire, and the
refusal to serve a non-loopback address that anyone could join."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from independent_client import IndependentClient, ServerProcess, call_error, generate_stubs
from wafl.common.config import ConfigError
from wafl.common.errors import Code, Refused
from wafl.server.app import check_exposure
from wafl.server.auth import (
    Credentials,
    JoinSecrets,
    check_id,
    check_token,
    hash_secret,
    load_enrollment,
    load_or_create_key,
    verify_secret,
)

SECRETS = {0: "secret-of-zero-0123456789", 1: "secret-of-one-0123456789"}
HASHES = {i: hash_secret(s) for i, s in SECRETS.items()}


def enrollment_text(hashes: dict[int, str] = HASHES) -> str:
    return "".join(f"{i} {h}\n" for i, h in hashes.items())


def test_credentials_bind_run_index_and_client(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path)
    assert load_or_create_key(tmp_path) == key and len(key) == 32  # kept: credentials survive a restart
    assert (tmp_path / "server.key").stat().st_mode & 0o077 == 0
    creds = Credentials(key, "run-1")
    c = creds.issue("alice", 3)
    owners = {3: "alice", 4: "bob"}
    assert creds.check(c, "alice", owners.get) == 3
    with pytest.raises(Refused, match="another client") as e:
        creds.check(c, "bob", owners.get)
    assert e.value.code == Code.PERMISSION_DENIED
    for bad in ("", "3." + "0" * 64, "garbage", c[:-1] + ("0" if c[-1] != "0" else "1")):
        with pytest.raises(Refused) as e:
            creds.check(bad, "alice", owners.get)
        assert e.value.code == Code.UNAUTHENTICATED
    assert Credentials(key, "run-2").index_of(c, "alice") is None  # another run
    assert Credentials(os.urandom(32), "run-1").index_of(c, "alice") is None  # another key


def test_join_secrets_and_ids() -> None:
    assert JoinSecrets().open and JoinSecrets().admits(0, "")
    assert JoinSecrets("t").admits(5, "t") and not JoinSecrets("t").admits(5, "u")
    enrolled = JoinSecrets(enrollment=HASHES)
    assert enrolled.admits(0, SECRETS[0]) and not enrolled.admits(1, SECRETS[0]) and not enrolled.admits(2, "")
    check_id("client_id", "client-7.a_b:c@d")
    for bad in ("", "x" * 65, "has space", "ünï"):
        with pytest.raises(Refused):
            check_id("client_id", bad)


def test_enrollment_file_is_checked(tmp_path: Path) -> None:
    f = tmp_path / "enroll.txt"
    f.write_text(f"# index hash\n0 {HASHES[0]}\n\n1 {HASHES[1]}  # b\n")
    assert load_enrollment(str(f), 2) == HASHES
    assert HASHES[0] != hash_secret(SECRETS[0])  # salted: the same secret never gives the same line
    assert verify_secret(SECRETS[0], HASHES[0]) and not verify_secret(SECRETS[1], HASHES[0])
    for text, match in [
        ("0 secret-of-zero-0123456789\n1 secret-of-one-0123456789\n", "not a salted hash"),
        (f"2 {HASHES[0]}\n", "INDEX in 0..1"),
        (f"0 {HASHES[0]}\n0 {HASHES[1]}\n1 {HASHES[1]}\n", "appears twice"),
        ("# nothing\n", "no secret for client_index 0, 1"),
        (f"0 {HASHES[0]}\n", "no secret for client_index 1"),
        (f"x {HASHES[0]}\n", "line 1"),
    ]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_enrollment(str(f), 2)
    f.write_bytes(b"\xff\xfe0 secret")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_enrollment(str(f), 2)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_enrollment(str(tmp_path / "missing.txt"), 2)


def test_an_open_server_stays_on_loopback(tmp_path: Path) -> None:
    for host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        check_exposure(host, JoinSecrets(), allow_open=False)
    for host in ("0.0.0.0", "10.0.0.5", "example.org"):
        with pytest.raises(ConfigError, match="--allow-open"):
            check_exposure(host, JoinSecrets(), allow_open=False)
        check_exposure(host, JoinSecrets(), allow_open=True)
        check_exposure(host, JoinSecrets("t"), allow_open=False)
        check_exposure(host, JoinSecrets(enrollment=HASHES), allow_open=False)
    done = subprocess.run(
        [sys.executable, "-m", "wafl.cli.main", "server", "--host", "0.0.0.0", "--port", "0", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "WAFL_TOKEN"},
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--allow-open" in done.stderr.strip().splitlines()[-1]


def test_enrolled_clients_join_only_as_themselves(tmp_path: Path) -> None:
    pb, pb_grpc = generate_stubs(tmp_path / "stubs")
    enroll = tmp_path / "enroll.txt"
    enroll.write_text(enrollment_text())
    config = {"num_clients": 2, "rounds": 1, "join_timeout_s": 120, "checkpoint": False}
    server = ServerProcess(config, tmp_path / "server", extra_args=["--enrollment", str(enroll)])
    clients = [IndependentClient(pb, pb_grpc, server.address, f"c{i}", i, 10) for i in range(2)]
    try:
        c0, c1 = clients
        err = call_error(lambda: c0.join(token=SECRETS[1]))  # the other index's secret
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "enrollment secret" in err.details()
        assert c0.join(token=SECRETS[0]).session_credential.startswith("0.")
        # index 0 is c0's: another id with index 0's secret is refused; c0 itself may join again
        intruder = IndependentClient(pb, pb_grpc, server.address, "intruder", 0, 10)
        try:
            err = call_error(lambda: intruder.join(token=SECRETS[0]))
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        finally:
            intruder.close()
        first = c0.credential
        assert c0.join(token=SECRETS[0]).session_credential == first
        assert c1.join(token=SECRETS[1]).session_credential.startswith("1.")
        assert server.alive()
    finally:
        for c in clients:
            c.close()
        server.stop()


def test_tokens_are_long_and_never_on_the_command_line(tmp_path: Path) -> None:
    check_token("")  # none: an open (loopback) server
    check_token("t" * 16)
    for bad in (" ", "short-token", " " * 20 + "x"):
        with pytest.raises(ConfigError, match="16 to 256"):
            check_token(bad)
    env = {k: v for k, v in os.environ.items() if k != "WAFL_TOKEN"}
    base = [sys.executable, "-m", "wafl.cli.main", "server", "--host", "127.0.0.1", "--port", "0"]
    flag = subprocess.run(
        [*base, "--out", str(tmp_path / "a"), "--token", "a-token-of-32-characters-0123456"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert flag.returncode == 2 and "Traceback" not in flag.stderr
    assert "/proc/PID/cmdline" in flag.stderr and "WAFL_TOKEN" in flag.stderr
    short = subprocess.run(
        [*base, "--out", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "WAFL_TOKEN": " "},
    )
    assert short.returncode == 2 and "16 to 256" in short.stderr.strip().splitlines()[-1]


def test_wafl_enroll_writes_hashes_and_private_secrets(tmp_path: Path) -> None:
    out, folder = tmp_path / "enroll.txt", tmp_path / "secrets"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "wafl.cli.main",
            "enroll",
            "--clients",
            "3",
            "--out",
            str(out),
            "--secrets-dir",
            str(folder),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    hashes = load_enrollment(str(out), 3)
    for i in range(3):
        secret = (folder / f"client-{i}.secret").read_text().strip()
        assert len(secret) >= 16 and secret not in out.read_text()
        assert JoinSecrets(enrollment=hashes).admits(i, secret) and not JoinSecrets(enrollment=hashes).admits(i, "x")
        assert (folder / f"client-{i}.secret").stat().st_mode & 0o077 == 0
    assert out.stat().st_mode & 0o077 == 0
    plain = tmp_path / "plain.txt"
    plain.write_text("".join(f"{i} {s}\n" for i, s in SECRETS.items()))
    done = subprocess.run(
        [sys.executable, "-m", "wafl.cli.main", "enroll", "--clients", "2", "--out", str(out), "--from", str(plain)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert JoinSecrets(enrollment=load_enrollment(str(out), 2)).admits(1, SECRETS[1])

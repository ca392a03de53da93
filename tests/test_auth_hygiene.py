"""Failed authentication leaves a trace and is rate limited; weak secrets and open secret files are warned of;
``--enrollment``'s help names the file ``wafl enroll`` makes; a checkpoint write killed before its rename
leaves nothing behind once the server starts again.

Before: 50,925 wrong-secret Joins left no log line and were all answered; an enrollment file of mode 0644
and a token of 16 repeated characters were taken without a word; the help described the old plaintext
``INDEX SECRET`` format; ``checkpoint.pt.tmp<pid>`` stayed forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from independent_client import IndependentClient, ServerProcess, call_error, expect_status
from wafl.common.errors import Code, Refused
from wafl.server.auth import hash_secret, weak_secret
from wafl.server.checkpoint import remove_stale_temporaries
from wafl.server.limits import FailedJoins, peer_host

CONFIG = {"num_clients": 2, "rounds": 2, "join_timeout_s": 120, "checkpoint": False, "eval_every": 0}
WEAK = "a" * 16  # the length a token must have, one distinct character


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_failed_joins_are_limited_per_address_and_refill() -> None:
    clock = Clock()
    f = FailedJoins(burst=5, per_s=0.5, log_every_s=10, clock=clock)
    for _ in range(5):
        f.check("ipv4:10.0.0.1")
        f.failed("ipv4:10.0.0.1")
    with pytest.raises(Refused) as e:
        f.check("ipv4:10.0.0.1")
    assert e.value.code == Code.RESOURCE_EXHAUSTED and "retry in 2 s" in str(e.value)
    f.check("ipv4:10.0.0.2")  # another address has its own budget
    clock.now += 2.0  # one failure's worth refilled
    f.check("ipv4:10.0.0.1")
    f.failed("ipv4:10.0.0.1")
    with pytest.raises(Refused):
        f.check("ipv4:10.0.0.1")
    assert (f.total, f.throttled) == (6, 2)
    assert peer_host("ipv4:10.0.0.1:51234") == "ipv4:10.0.0.1"
    assert peer_host("ipv6:[::1]:51234") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"


def test_weak_secrets_are_named() -> None:
    assert weak_secret(WEAK) is not None and "1 distinct" in str(weak_secret(WEAK))
    assert weak_secret("abababababababab") is not None
    assert weak_secret("Zq3-vT8_pL1xR6wN") is None


def test_a_server_logs_and_limits_failed_joins_and_warns_of_a_weak_token(stubs, tmp_path: Path) -> None:
    pb, pb_grpc = stubs
    token_file = tmp_path / "token"
    token_file.write_text(WEAK)
    stale = tmp_path / "w" / "out" / "checkpoint.pt.tmp4242"  # a write killed before its rename
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"partial")
    (stale.parent / "checkpoints").mkdir()
    (stale.parent / "checkpoints" / "round-3.pt.tmp77").write_bytes(b"partial")
    server = ServerProcess(CONFIG, tmp_path / "w", extra_args=["--token-file", str(token_file)])
    guesser = IndependentClient(pb, pb_grpc, server.address, "guesser", 0, 10)
    try:
        assert not stale.exists() and not (stale.parent / "checkpoints" / "round-3.pt.tmp77").exists()
        assert server.events("checkpoint.stale_removed")
        assert server.events("auth.weak_token")
        codes = []
        for i in range(30):
            guesser.token = f"wrong-token-{i:04d}-0123456789"
            codes.append(call_error(lambda: guesser.join()).code())
        assert codes[:20] == [grpc.StatusCode.UNAUTHENTICATED] * 20
        assert set(codes[21:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        # during the lockout even the right token is refused at once: guessing runs no faster
        guesser.token = WEAK
        expect_status(call_error(lambda: guesser.join()), grpc.StatusCode.RESOURCE_EXHAUSTED, "retry in")
        lines = server.events("auth.failed")
        assert lines and lines[0]["failed"] >= 1 and lines[0]["addresses"] == ["ipv4:127.0.0.1"]
        assert len(lines) <= 2  # rate limited: at most one line every 10 s
        assert server.alive(), server.log_tail()
    finally:
        guesser.close()
        server.stop()


def test_an_enrollment_file_others_can_read_is_warned_of(tmp_path: Path) -> None:
    enroll = tmp_path / "enroll.txt"
    enroll.write_text("".join(f"{i} {hash_secret(f'secret-number-{i}-0123456789')}\n" for i in range(2)))
    os.chmod(enroll, 0o644)
    server = ServerProcess(CONFIG, tmp_path / "w", extra_args=["--enrollment", str(enroll)])
    try:
        (warning,) = server.events("auth.file_not_private")
        assert warning["mode"] == "0644" and warning["flag"] == "--enrollment"
    finally:
        server.stop()
    os.chmod(enroll, 0o600)
    server = ServerProcess(CONFIG, tmp_path / "w2", extra_args=["--enrollment", str(enroll)])
    try:
        assert server.events("auth.file_not_private") == []
    finally:
        server.stop()


def test_enrollment_help_names_the_hashed_format() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wafl.cli.main", "server", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    text = " ".join(out.split())
    assert "sha256:SALT:DIGEST" in text and "wafl enroll" in text
    assert "'INDEX SECRET'" not in text


def test_stale_temporaries_are_removed_but_not_this_process(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    mine = tmp_path / f"checkpoint.pt.tmp{os.getpid()}"
    for p in (tmp_path / "checkpoint.pt.tmp1", tmp_path / "checkpoints" / "round-12.pt.tmp3", mine):
        p.write_bytes(b"x")
    keep = tmp_path / "checkpoint.pt.tmpfoo"  # not a pid: not ours to remove
    keep.write_bytes(b"x")
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == ["checkpoint.pt.tmp1", "round-12.pt.tmp3"]
    assert mine.exists() and keep.exists()

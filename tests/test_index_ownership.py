"""Index ownership survives --resume: the owner re-claims its index with its credential (or its
enrollment secret), a bare token never takes it over, and ``server.key`` alone forges nothing."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from wafl.common.config import load_config
from wafl.common.errors import Code, Refused
from wafl.common.proto import federation_pb2 as pb
from wafl.server.auth import hash_secret
from wafl.server.engine import RoundEngine

TOKEN = "index-ownership-token-0123456789"
CFG = {"num_clients": 2, "rounds": 2}


def request(client_id: str, index: int, token: str = TOKEN) -> pb.JoinRequest:
    return pb.JoinRequest(client_id=client_id, protocol_version=1, client_index=index, num_samples=10, token=token)


def engine(out: Path, resume: bool, token: str = TOKEN, **kw) -> RoundEngine:
    e = RoundEngine(load_config(None, CFG), out, token=token, resume=resume, **kw)
    e.executor.shutdown(wait=False)
    return e


def refused(fn, code: Code, fragment: str = "") -> None:
    with pytest.raises(Refused) as e:
        fn()
    assert e.value.code == code and fragment in str(e.value), (e.value.code, str(e.value))


def test_a_bare_token_never_takes_an_owned_index_after_resume(tmp_path: Path) -> None:
    first = engine(tmp_path, resume=False)
    credential = first.join(request("alice", 0)).session_credential
    first.join(request("bob", 1))
    first.write_checkpoint(tmp_path / "checkpoint.pt")  # as the round loop writes it
    resumed = engine(tmp_path, resume=True)
    assert resumed.roster.index_owner == {0: "alice", 1: "bob"}
    refused(lambda: resumed.join(request("mallory", 0)), Code.ALREADY_EXISTS, "client_index 0")
    refused(lambda: resumed.join(request("alice", 0)), Code.PERMISSION_DENIED, "session credential")
    assert resumed.join(request("alice", 0), credential).session_credential == credential  # the owner re-claims it
    # an index out of range is answered like a bad token, before the range is told
    refused(lambda: resumed.join(request("eve", 7, token="wrong-token-0123456789")), Code.UNAUTHENTICATED, "token")
    refused(lambda: resumed.join(request("eve", 7)), Code.INVALID_ARGUMENT, "outside 0..1")


def test_server_key_alone_forges_no_credential(tmp_path: Path) -> None:
    first = engine(tmp_path, resume=False)
    credential = first.join(request("alice", 0)).session_credential
    first.write_checkpoint(tmp_path / "checkpoint.pt")  # as the round loop writes it
    assert stat.S_IMODE((tmp_path / "server.key").stat().st_mode) == 0o600
    # whoever holds server.key but not the token derives another key: the credential is not theirs to make
    other = engine(tmp_path, resume=True, token="another-token-of-the-thief-0123")
    assert other.roster.credentials.issue("alice", 0) != credential
    refused(
        lambda: other.join(request("alice", 0, token="another-token-of-the-thief-0123"), credential),
        Code.PERMISSION_DENIED,
    )


def test_an_enrolled_client_reclaims_its_index_with_its_secret(tmp_path: Path) -> None:
    secrets = {0: "secret-of-zero-0123456789", 1: "secret-of-one-0123456789"}
    hashes = {i: hash_secret(s) for i, s in secrets.items()}
    first = engine(tmp_path, resume=False, token="", enrollment=hashes)
    first.join(request("alice", 0, token=secrets[0]))
    first.write_checkpoint(tmp_path / "checkpoint.pt")  # as the round loop writes it
    resumed = engine(tmp_path, resume=True, token="", enrollment=hashes)
    refused(lambda: resumed.join(request("mallory", 0, token=secrets[0])), Code.ALREADY_EXISTS)
    refused(lambda: resumed.join(request("alice", 0, token=secrets[1])), Code.UNAUTHENTICATED)
    assert resumed.join(request("alice", 0, token=secrets[0])).session_credential.startswith("0.")
    refused(lambda: resumed.join(request("eve", 9, token=secrets[0])), Code.UNAUTHENTICATED)  # range not told

"""What a client keeps, and what a run folder exposes: client state files are verified and never
unpickled, a round begun again trains from where it first began, run folders are private."""

from __future__ import annotations

import hashlib
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
from algorithm_checks import client, global_payload
from wafl.client.trainer import STATE_MAGIC
from wafl.common.datasets import load_dataset
from wafl.common.verified import VerifiedFileError, load_verified, save_verified
from wafl.server.app import check_out_dir


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/wafl-state-file-was-unpickled",))


def test_a_state_file_is_verified_and_never_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "client-0.pt"
    save_verified(path, {"fingerprint": "x", "pm": {"w": torch.ones(2)}}, STATE_MAGIC)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert torch.equal(load_verified(path, STATE_MAGIC, "client state")["pm"]["w"], torch.ones(2))
    payload = pickle.dumps({"fingerprint": Boom()}, protocol=2)  # torch.load's own protocol (no warning)
    path.write_bytes(STATE_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    with pytest.raises(VerifiedFileError, match="not tensors and plain values"):
        load_verified(path, STATE_MAGIC, "client state")
    assert not Path("/tmp/wafl-state-file-was-unpickled").exists()
    torch.save({"fingerprint": "x"}, path)  # no header, no checksum: refused before decoding
    with pytest.raises(VerifiedFileError, match="not a wafl client state"):
        load_verified(path, STATE_MAGIC, "client state")
    save_verified(path, {"a": 1}, STATE_MAGIC)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(VerifiedFileError, match="checksum mismatch"):
        load_verified(path, STATE_MAGIC, "client state")


@pytest.mark.parametrize("algorithm", ["fedavg", "feddyn"])
def test_a_round_begun_again_trains_the_same_update(tmp_path: Path, algorithm: str) -> None:
    t = client(load_dataset("digits"), algorithm, state_dir=tmp_path)
    g = global_payload(t)
    t.begin_round(1, g)
    t.train_gm()
    t.begin_round(2, t.gm_upload_state())  # the model of round 2, as a server would send it
    round2 = {k: v.clone() for k, v in t.gm.state_dict().items()}
    start = global_payload(t)
    t.train_gm()
    first = {k: v.clone() for k, v in t.gm_upload_state().items()}
    state_after = {k: [x.clone() for x in v] if isinstance(v, list) else v for k, v in t.client_state.items()}
    # the server was killed before it aggregated round 2 and resumed: round 2 opens again
    t.begin_round(2, start)
    assert all(torch.equal(round2[k], v) for k, v in t.gm.state_dict().items())
    t.train_gm()
    again = t.gm_upload_state()
    for k, v in first.items():
        assert torch.equal(v, again[k]), k
    if algorithm == "feddyn":  # its client state is not updated twice
        for k, v in state_after.items():
            for a, b in zip(v, t.client_state[k]):
                assert torch.equal(a, b)


def test_run_folders_are_private(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "server.jsonl").write_text("{}\n")
    os.chmod(run / "logs" / "server.jsonl", 0o644)
    old = os.umask(0o022)
    try:
        check_out_dir(run, resume=True)
        assert stat.S_IMODE(run.stat().st_mode) == 0o700
        assert stat.S_IMODE((run / "logs").stat().st_mode) == 0o700
        assert stat.S_IMODE((run / "logs" / "server.jsonl").stat().st_mode) == 0o600
        (run / "results.jsonl").write_text("")
        assert stat.S_IMODE((run / "results.jsonl").stat().st_mode) == 0o600
    finally:
        os.umask(old)

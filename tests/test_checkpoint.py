"""Checkpoints: tensors-only loading, checksums, and one-line errors for crafted, corrupt, truncated,
foreign or mismatched files; a new run never writes into a folder holding another run."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from wafl.server.checkpoint import MAGIC, CheckpointError, load_checkpoint, save_checkpoint


def state() -> dict:
    return {
        "round": 2,
        "run_id": "abc123",
        "config": {"num_clients": 2, "params": {}, "act_prob": None},
        "global_state": OrderedDict(w=torch.arange(6.0).reshape(2, 3), n=torch.tensor(3)),
        "server_state": {"h": {"w": torch.ones(2, 3)}},
        "knowledge": {1: {"count": 4, "rep": torch.zeros(3), "soft": torch.full((2,), 0.5)}},
    }


class Payload:
    """Unpickling this runs code: writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def framed(payload: bytes) -> bytes:
    import hashlib

    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def test_round_trip_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, state())
    ck = load_checkpoint(path)
    assert ck is not None and ck["round"] == 2 and ck["run_id"] == "abc123" and ck["config"] == state()["config"]
    for k, v in state()["global_state"].items():
        assert torch.equal(ck["global_state"][k], v)
    assert torch.equal(ck["server_state"]["h"]["w"], torch.ones(2, 3))
    assert ck["knowledge"][1]["count"] == 4
    assert load_checkpoint(tmp_path / "none.pt") is None
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left behind


def test_crafted_pickle_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for payload in (
        pickle.dumps({**state(), "x": Payload(marker)}, protocol=2),
        _torch_bytes({**state(), "x": Payload(marker)}),
    ):
        path = tmp_path / "checkpoint.pt"
        path.write_bytes(framed(payload))  # even with a valid header and checksum
        with pytest.raises(CheckpointError, match="not tensors and plain values") as e:
            load_checkpoint(path)
        assert str(path) in str(e.value)
        assert not marker.exists()


def _torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_corrupt_truncated_and_foreign_files(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, state())
    good = path.read_bytes()
    cases = {
        "checksum mismatch": good[:-1] + bytes([good[-1] ^ 1]),  # one bit flipped
        "checksum mismatch ": good[: len(good) // 2],  # truncated
        "not a wafl checkpoint": _torch_bytes(state()),  # a plain torch.save (the old format)
        "not a wafl checkpoint ": b"\x00" * 100,
        "truncated header": MAGIC + b"12",
        "missing entries": framed(_torch_bytes({"round": 1})),
    }
    for what, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(path)
        assert what.strip() in str(e.value) and str(path) in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def wafl(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "wafl.cli.main", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def one_line_error(done: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("wafl: ")
    for f in fragments:
        assert f in line, line


def server_args(out: Path, *extra: str) -> list[str]:
    return ["server", "--host", "127.0.0.1", "--port", "0", "--out", str(out), "--quiet", "--clients", "2", *extra]


def test_server_refuses_bad_checkpoints_and_used_folders(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    ck = out / "checkpoint.pt"
    ck.write_bytes(b"junk")
    one_line_error(wafl(*server_args(out, "--resume")), str(ck), "not a wafl checkpoint")
    # a checkpoint of another configuration
    save_checkpoint(ck, {**state(), "config": {"num_clients": 5}})
    one_line_error(wafl(*server_args(out, "--resume")), str(ck), "different configuration")
    # without --resume the folder of another run is refused, whatever is in it
    (out / "results.jsonl").write_text(json.dumps({"round": 1}) + "\n")
    one_line_error(wafl(*server_args(out)), str(out), "already holds a run", "--resume")
    assert (out / "results.jsonl").read_text() == json.dumps({"round": 1}) + "\n"  # untouched


def test_a_buffered_run_takes_its_checkpoints_on_the_event_loop(tmp_path: Path, monkeypatch) -> None:
    """A buffered run's uploads go on arriving (event-loop handlers adding to the strategy's committed uploads)
    while a version is checkpointed. The checkpoint's contents are read on the event loop's thread and only the
    file is written in a worker thread: reading the committed uploads from the worker had raised "dictionary
    changed size during iteration" mid-run and aborted the server (``wafl bench async``'s buffered runs)."""
    import asyncio

    from wafl.cli.sim.simulate import simulate
    from wafl.common.config import load_config
    from wafl.server.setup import Checkpoints
    from wafl.server.strategies.base import Strategy

    def on_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    seen: dict[str, list[bool]] = {"committed_uploads": [], "save": []}
    committed, save = Strategy.committed_uploads, Checkpoints.save

    def committed_on(self, *args):  # noqa: ANN001, ANN202
        seen["committed_uploads"].append(on_loop())
        return committed(self, *args)

    def save_on(self, *args):  # noqa: ANN001, ANN202
        seen["save"].append(on_loop())
        return save(self, *args)

    monkeypatch.setattr(Strategy, "committed_uploads", committed_on)
    monkeypatch.setattr(Checkpoints, "save", save_on)
    settings = {"num_clients": 4, "rounds": 4, "aggregation": "buffered", "buffer_size": 2, "checkpoint": True}
    rows = simulate(load_config(None, settings), tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert seen == {"committed_uploads": [True] * 4, "save": [False] * 4}  # read on the loop, written off it
    ck = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    assert ck is not None and ck["round"] == 4 and ck["uploads"]

"""A client in another language: the Node.js client in ``tests/node_client/``, written from
``protos/wafl/v1/federation.proto`` alone, finishes a federation beside a real ``wafl client``.

The server and the ``wafl client`` run as processes; the Node.js client joins as index 0, checks
every broadcast (manifest order, byte offsets, chunk count, CRC-32), uploads for every round it
is asked to train in (clients are activated at random: some rounds select it alone, some the
``wafl client`` alone, some both), ignores the reply of one upload and cancels another right
after its trailer, retrying both under the same idempotency key, and sends its final report. The
test then re-computes every aggregate: the ``wafl client``'s updates by replaying its training in
this process (the same configuration, index and received models), the Node.js client's from the
bytes it uploaded, FedAvg of the selected clients by their declared sample counts; and the
results' ``train_loss`` as the mean of the selected clients' losses weighted by samples.

The npm packages come from ``scripts/node_modules.sh`` (a cache outside the clone, keyed by the
lockfile, installed with ``npm ci`` from the registry when missing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from independent_client import NUMPY_BY_DTYPE_NAME, REPO, ServerProcess
from wafl.client.trainer import Trainer
from wafl.common.config import RunConfig
from wafl.server.selection import select_clients

ROUNDS = 4
NODE_SAMPLES = 300
CONFIG = {
    "num_clients": 2,
    "rounds": ROUNDS,
    "act_prob": 0.6,  # with seed 0: the Node.js client alone, both twice, the wafl client alone
    "broadcast_all": True,  # every model to both clients: the re-computation below reads each one
    "dataset": "synthetic-cifar10",  # its cnn has an 8 MiB tensor: broadcasts mix single chunks and batches
    "model": "cnn",
    "algorithm": "fedavg",
    "local_epochs": 1,
    "eval_every": 0,
    "checkpoint": False,
    "seed": 0,
    "join_timeout_s": 180,
    "round_deadline_s": 180,
}


def node_modules() -> str:
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "node_modules.sh")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"scripts/node_modules.sh failed:\n{done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]


def read_tensors(path: Path, manifest: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    out, pos = {}, 0
    for s in manifest:
        dt = NUMPY_BY_DTYPE_NAME[s["dtype"]]
        n = int(np.prod(s["shape"], dtype=np.int64)) * dt.itemsize
        out[s["name"]] = np.frombuffer(raw[pos : pos + n], dtype=dt).reshape(s["shape"])
        pos += n
    assert pos == len(raw), f"{path.name}: {len(raw)} bytes, manifest says {pos}"
    return out


def test_node_client_finishes_a_federation_beside_a_wafl_client(tmp_path: Path) -> None:
    ids = ["node-0", "client-1"]  # in index order
    selected = {r: select_clients(CONFIG["seed"], r, ids, 1.0, CONFIG["act_prob"]) for r in range(1, ROUNDS + 1)}
    assert {frozenset(s) for s in selected.values()} == {frozenset(ids), frozenset(ids[:1]), frozenset(ids[1:])}
    both = [r for r in range(1, ROUNDS + 1) if selected[r] == set(ids)]
    drop_round, cancel_round = both[0], both[1]
    modules = node_modules()
    server = ServerProcess(CONFIG, tmp_path / "server")
    node_out = tmp_path / "node"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    node = wafl = None
    try:
        node = subprocess.Popen(
            [
                "node",
                str(REPO / "tests" / "node_client" / "client.js"),
                *("--server", server.address, "--proto", str(REPO / "protos" / "wafl" / "v1" / "federation.proto")),
                *("--index", "0", "--client-id", "node-0", "--num-samples", str(NODE_SAMPLES)),
                *("--out", str(node_out), "--drop-reply-round", str(drop_round)),
                *("--cancel-round", str(cancel_round)),
            ],
            env=dict(env, NODE_PATH=modules),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        wafl = subprocess.Popen(
            [sys.executable, "-m", "wafl.cli.main", "client", "--server", server.address, "--index", "1"]
            + ["--threads", "1", "--quiet"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        node_log, _ = node.communicate(timeout=600)
        assert node.returncode == 0, f"node client failed:\n{node_log[-3000:]}\n{server.log_tail()}"
        wafl_log, _ = wafl.communicate(timeout=300)
        assert wafl.returncode == 0, f"wafl client failed:\n{wafl_log[-3000:]}"
        assert server.proc.wait(timeout=120) == 0, server.log_tail()
    finally:
        for p in (node, wafl):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        server.stop()
    # every final report arrived: the server did not wait for missing ones
    assert server.events("final_reports.missing") == []

    summary = json.loads((node_out / "summary.json").read_text())
    manifest = summary["manifest"]
    models = {m["round"]: m for m in summary["models"]}
    assert sorted(models) == list(range(1, ROUNDS + 2)), sorted(models)
    assert models[ROUNDS + 1]["final"] and not models[ROUNDS + 1]["train"]
    for r in range(1, ROUNDS + 1):
        assert models[r]["train"] == ("node-0" in selected[r]) and not models[r]["final"]
    for m in models.values():
        assert m["singles"] > 0 and m["batches"] > 0, m  # both kinds of tensor message arrived
        assert zlib.crc32((node_out / f"recv-{m['round']}.bin").read_bytes()) == m["crc32"]
    uploads = {u["round"]: u for u in summary["uploads"]}
    assert sorted(uploads) == [r for r in range(1, ROUNDS + 1) if "node-0" in selected[r]]
    for u in uploads.values():
        assert u["singles"] > 0 and u["batches"] > 0, u
        assert u["attempts"][-1]["status"] == "OK"
    # the first reply was dropped; the retry under the same key got the same answer
    dropped = uploads[drop_round]["attempts"]
    assert [a["status"] for a in dropped] == ["OK", "OK"], dropped
    # cancelled after the trailer; committed or rolled back, the retry is answered OK
    cancelled = uploads[cancel_round]["attempts"]
    assert cancelled[0]["mode"] == "cancel" and cancelled[-1]["status"] == "OK", cancelled
    assert summary["final_reported"]

    # re-computation: the wafl client's training replayed here (it trains only when selected), the
    # FedAvg of the selected clients' updates by their declared samples
    cfg = RunConfig.from_json((server.out_dir / "config.json").read_text()).validate()
    trainer = Trainer(cfg, 1, device="cpu")
    node_samples = float(summary["num_samples"])  # --num-samples, at most JoinReply.max_samples
    assert 0 < node_samples <= NODE_SAMPLES
    losses = []
    for r in range(1, ROUNDS + 1):
        received = read_tensors(node_out / f"recv-{r}.bin", manifest)
        updates: list[tuple[float, dict[str, np.ndarray], float]] = []  # (samples, tensors, train_loss)
        if "node-0" in selected[r]:
            updates.append((node_samples, read_tensors(node_out / f"up-{r}.bin", manifest), 1 / (r + 1)))
        if "client-1" in selected[r]:
            trainer.begin_round(r, {k: torch.from_numpy(v.copy()) for k, v in received.items()})
            stats = trainer.train_gm()
            wafl_update = {k: v.numpy() for k, v in trainer.gm_upload_state().items()}
            updates.append((float(trainer.num_samples), wafl_update, stats.mean_loss))
        total_samples = sum(n for n, _, _ in updates)
        losses.append(sum(n * loss for n, _, loss in updates) / total_samples)
        got = read_tensors(node_out / f"recv-{r + 1}.bin", manifest)
        for name, value in got.items():
            total = sum(n * t[name].astype(np.float64) for n, t, _ in updates)
            expected = (total * (1.0 / total_samples)).astype(value.dtype)
            np.testing.assert_array_max_ulp(value, expected, maxulp=1)  # the server sums in float64
    rows = [json.loads(line) for line in (server.out_dir / "results.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == list(range(1, ROUNDS + 1))
    # the retried uploads counted once
    assert [row["clients"] for row in rows] == [len(selected[r]) for r in range(1, ROUNDS + 1)]
    for row, loss in zip(rows, losses, strict=True):
        assert abs(row["train_loss"] - loss) < 1e-5, (row["train_loss"], loss)

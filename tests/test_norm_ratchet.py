"""The default norm bound cannot be ratcheted by an attacker holding half of a round's uploads.

A real ``wafl server`` process with the default adaptive bound (``norm_bound`` 10, no ``clip_norm``)
and two clients built from the .proto alone: one uploads its base model plus 1e6 in every float
coordinate every round, the other an honest update (the base plus seeded noise). For 20 rounds the
bound each round is clipped to (the server's ``round.clipped`` line) must stay within ``multiple`` x
the largest honest update norm of the rounds its window covers (the threat model's promise), and the
model may move at most by the clipped updates' weighted mean. With the mean of the two middle norms as
the median, the attacker's clipped norm entered it every round and the bound grew about 5x every 3
rounds (10 -> 67 -> 354 -> ... -> 44,921 by round 16).
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from independent_client import Model, tensor_chunks, upload_messages
from support.federation import JoinedFederation, serving

TOKEN = "ratchet-tests-" + uuid.uuid4().hex
NUM_SAMPLES = (50, 50)
ROUNDS = 20
MULTIPLE = 10.0  # norm_bound's default
WINDOW = 3  # NormBound's window of collections
CONFIG = {
    "num_clients": 2,
    "rounds": ROUNDS,
    "round_deadline_s": 90,
    "join_timeout_s": 60,
    "local_epochs": 1,
    "eval_every": 0,
    "checkpoint": False,
    "seed": 0,
}


class Fed(JoinedFederation):
    def __init__(self, pb: Any, pb_grpc: Any, server: Any) -> None:
        super().__init__(pb, pb_grpc, server, "ratchet", NUM_SAMPLES, TOKEN)

    def send(self, index: int, r: int, tensors: dict[str, np.ndarray]) -> None:
        c = self.clients[index]
        h = c.header(r, uuid.uuid4().hex)
        assert c.upload(upload_messages(self.pb, h, tensor_chunks(self.pb, self.manifest, tensors))).accepted


def floats(m: Model) -> list[str]:
    return [k for k, v in m.tensors.items() if v.dtype.kind == "f"]


def distance(x: dict[str, np.ndarray], base: Model) -> float:
    return math.sqrt(
        sum(float(((x[k].astype(np.float64) - base.tensors[k].astype(np.float64)) ** 2).sum()) for k in floats(base))
    )


def test_half_of_the_uploads_cannot_ratchet_the_default_bound(stubs, tmp_path: Path) -> None:
    pb, pb_grpc = stubs
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    honest_norms: dict[int, float] = {}
    moved: dict[int, float] = {}
    with serving(lambda s: Fed(pb, pb_grpc, s), CONFIG, tmp_path / "w", ["--token-file", str(token_file)]) as fed:
        for r in range(1, ROUNDS + 1):
            base = fed.a.listener.wait(r, timeout=120)
            attack = {k: (v + np.asarray(1e6, v.dtype)) if v.dtype.kind == "f" else v for k, v in base.tensors.items()}
            rng = np.random.default_rng([r, 23])
            honest = {
                k: (v + rng.standard_normal(v.shape) * 0.01).astype(v.dtype) if v.dtype.kind == "f" else v
                for k, v in base.tensors.items()
            }
            honest_norms[r] = distance(honest, base)
            fed.send(0, r, attack)
            fed.send(1, r, honest)
            new = fed.a.listener.wait(r + 1, timeout=120)
            moved[r] = distance(new.tensors, base)
        events = {int(e["round"]): float(e["bound"]) for e in fed.server.events("round.clipped")}
    assert sorted(events) == list(range(1, ROUNDS + 1)), events  # the attacker was clipped every round
    for r in range(2, ROUNDS + 1):
        window = [honest_norms[q] for q in range(max(1, r - WINDOW), r)]
        promise = MULTIPLE * max(window)
        assert events[r] <= promise * (1 + 1e-6), (r, events[r], promise, events)
        # the model moves at most by the weighted mean of two updates within the bound
        assert moved[r] <= (events[r] + honest_norms[r]) / 2 * (1 + 1e-4), (r, moved[r], events[r])

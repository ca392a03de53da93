"""Knowledge on the wire (FedHKD/FedProto channel): bad contents refused precisely, the global
model and knowledge untouched, and the server's aggregate exactly the count-weighted mean."""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import numpy as np
import pytest
from independent_client import (
    IndependentClient,
    ServerProcess,
    call_error,
    generate_stubs,
    join_clients,
    tensor_chunks,
    upload_messages,
)

NUM_SAMPLES = (40, 60)
CODE_LEN = 32
CLASSES = 10
CONFIG = {
    "num_clients": 2,
    "rounds": 40,
    "round_deadline_s": 60,
    "join_timeout_s": 120,
    "eval_every": 0,
    "checkpoint": False,
    "algorithm": "fedhkd",
    "code_len": CODE_LEN,
}


def knowledge(pb: Any, seed: int, classes: dict[int, int]) -> list[Any]:
    rng = np.random.default_rng(seed)
    out = []
    for j, n in classes.items():
        soft = rng.random(CLASSES)
        soft /= soft.sum()
        out.append(
            pb.ClassKnowledge(
                class_id=j, count=n, representation=rng.normal(size=CODE_LEN).tolist(), soft_prediction=soft.tolist()
            )
        )
    return out


class Fed:
    def __init__(self, pb: Any, pb_grpc: Any, server: ServerProcess) -> None:
        self.pb = pb
        self.server = server
        self.clients = join_clients(pb, pb_grpc, server, "k", NUM_SAMPLES)
        self.manifest = list(self.clients[0].reply.manifest)

    def upload(
        self, c: IndependentClient, round: int, tensors: dict, know: list[Any], before_chunks: bool = False
    ) -> Any:
        msgs = upload_messages(
            self.pb, c.header(round, uuid.uuid4().hex), tensor_chunks(self.pb, self.manifest, tensors)
        )
        k = [self.pb.UploadMessage(knowledge=x) for x in know]
        msgs = msgs[:1] + k + msgs[1:] if before_chunks else msgs[:-1] + k + msgs[-1:]
        return c.upload(msgs)

    def round(self):
        m = self.clients[0].listener.latest()
        assert not m.final
        return m.round, m

    def complete(self, r: int, base) -> None:
        """Both clients upload valid models + knowledge; checks the next broadcast's knowledge and model."""
        ups = {}
        for c in self.clients:
            t = {
                k: v + np.float32(0.01 * (c.index + 1)) if v.dtype == np.float32 else v for k, v in base.tensors.items()
            }
            know = knowledge(self.pb, 100 * r + c.index, {0: 5 + c.index, 3 + c.index: 7})
            assert self.upload(c, r, t, know).accepted
            ups[c.index] = (t, know)
        nxt = self.clients[0].listener.wait(r + 1)
        # the model: FedAvg by declared sample counts
        tot = sum(NUM_SAMPLES)
        name = self.manifest[0].name
        want = sum(NUM_SAMPLES[i] * ups[i][0][name].astype(np.float64) for i in ups) / tot
        assert np.allclose(nxt.tensors[name], want, rtol=1e-6, atol=1e-7)
        # the knowledge: per class, weighted by count over the clients that shared it
        got = {k.class_id: k for k in nxt.knowledge}
        assert set(got) == {0, 3, 4}
        k0 = [next(x for x in ups[i][1] if x.class_id == 0) for i in (0, 1)]
        w = np.array([k.count for k in k0], dtype=float) / sum(k.count for k in k0)
        rep = sum(wi * np.array(k.representation) for wi, k in zip(w, k0))
        soft = sum(wi * np.array(k.soft_prediction) for wi, k in zip(w, k0))
        assert np.allclose(got[0].representation, rep, atol=1e-6) and np.allclose(
            got[0].soft_prediction, soft, atol=1e-6
        )
        assert got[0].count == sum(k.count for k in k0)
        only = next(x for x in ups[1][1] if x.class_id == 4)  # shared by one client: passed through
        assert np.allclose(got[4].representation, only.representation, atol=1e-6)
        assert self.server.alive(), self.server.log_tail()


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    pb, pb_grpc = generate_stubs(tmp_path_factory.mktemp("stubs"))
    server = ServerProcess(CONFIG, tmp_path_factory.mktemp("knowledge-server"))
    f = None
    try:
        f = Fed(pb, pb_grpc, server)
        f.clients[0].listener.wait(1)
        yield f
    finally:
        if f is not None:
            for c in f.clients:
                c.close()
        server.stop()


def test_valid_knowledge_round_trip(fed: Fed) -> None:
    r, base = fed.round()
    assert base.knowledge == [] or r > 1  # round 1 opens with no global knowledge
    fed.complete(r, base)  # asserts the aggregate of the two uploads, class by class
    assert {k.class_id for k in fed.clients[1].listener.wait(r + 1).knowledge} == {0, 3, 4}


def _bad(fed: Fed, mutate) -> tuple[grpc.RpcError, int, Any]:
    r, base = fed.round()
    know = knowledge(fed.pb, 7, {1: 5, 2: 6})
    mutate(know)
    c = fed.clients[0]
    err = call_error(
        lambda: fed.upload(
            c, r, {k: v + np.float32(1000) if v.dtype == np.float32 else v for k, v in base.tensors.items()}, know
        )
    )
    return err, r, base


@pytest.mark.parametrize(
    "case, mutate, words",
    [
        ("class out of range", lambda k: setattr(k[0], "class_id", CLASSES), f"class {CLASSES}"),
        ("negative class", lambda k: setattr(k[0], "class_id", -1), "class -1"),
        ("short representation", lambda k: k[0].representation.pop(), "rep"),
        ("short soft prediction", lambda k: k[1].soft_prediction.pop(), "soft"),
        ("NaN representation", lambda k: k[0].representation.__setitem__(3, float("nan")), "finite"),
        ("Inf soft prediction", lambda k: k[1].soft_prediction.__setitem__(0, float("inf")), "class 2"),
        ("soft does not sum to 1", lambda k: k[0].soft_prediction.__setitem__(0, k[0].soft_prediction[0] + 0.5), "sum"),
        ("zero count", lambda k: setattr(k[1], "count", 0), "count"),
        ("negative count", lambda k: setattr(k[0], "count", -3), "count"),
        ("duplicate class", lambda k: setattr(k[1], "class_id", k[0].class_id), "twice"),
    ],
)
def test_bad_knowledge_is_refused_and_leaves_nothing(fed: Fed, case: str, mutate, words: str) -> None:
    err, r, base = _bad(fed, mutate)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.code(), err.details())
    assert words in (err.details() or ""), (case, err.details())
    fed.complete(r, base)


def test_too_many_entries_and_knowledge_before_tensors(fed: Fed) -> None:
    r, base = fed.round()
    c = fed.clients[0]
    many = knowledge(fed.pb, 1, {j: 3 for j in range(CLASSES)}) + knowledge(fed.pb, 2, {0: 3})
    err = call_error(lambda: fed.upload(c, r, base.tensors, many))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than" in err.details()
    err = call_error(lambda: fed.upload(c, r, base.tensors, knowledge(fed.pb, 3, {0: 3}), before_chunks=True))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "after knowledge" in err.details()
    fed.complete(r, base)

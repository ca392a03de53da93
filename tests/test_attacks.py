"""Attacks on a server started with ``--token``, from a client built from the .proto alone.

One server process (two clients, ``clip_norm`` 10, ``upload_stall_s`` 2) serves the module; every
case uses one round of it. The attack comes first and must get its exact status with nothing
streamed or recorded; then both clients upload honest updates and the next broadcast must equal
the numpy re-computation of exactly those (with the attacker's accepted update clipped where the
case says so); the server must still be running.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import uuid
from typing import Any

import grpc
import numpy as np
import pytest
from independent_client import (
    CREDENTIAL_KEY,
    IndependentClient,
    Model,
    ServerProcess,
    call_error,
    expect_status,
    tensor_chunks,
    upload_messages,
)
from support.federation import JoinedFederation, serving

TOKEN = "attack-tests-" + uuid.uuid4().hex
NUM_SAMPLES = (30, 70)
CLIP = 10.0
CONFIG = {
    "num_clients": 2,
    "rounds": 40,
    "round_deadline_s": 90,
    "join_timeout_s": 60,
    "local_epochs": 1,
    "eval_every": 0,
    "checkpoint": False,
    "seed": 0,
    "clip_norm": CLIP,
    "upload_stall_s": 2.0,
}
Code = grpc.StatusCode
FORGED = 0.123456  # an accuracy no honest report carries


class Fed(JoinedFederation):
    def __init__(self, pb: Any, pb_grpc: Any, server: ServerProcess) -> None:
        super().__init__(pb, pb_grpc, server, "honest", NUM_SAMPLES, TOKEN)

    def stranger(self, client_id: str, index: int = 0) -> IndependentClient:
        return IndependentClient(self.pb, self.pb_grpc, self.server.address, client_id, index, 10)

    def open_round(self) -> tuple[int, Model]:
        assert self.server.alive(), self.server.log_tail()
        model = self.a.listener.latest()
        assert not model.final and model.train
        return model.round, model

    def honest(self, base: Model, client: IndependentClient) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([base.round, client.index, 23])
        return {k: (v + rng.standard_normal(v.shape) * 0.01).astype(v.dtype) for k, v in base.tensors.items()}

    def messages(self, client: IndependentClient, round: int, tensors: dict[str, np.ndarray], **header: Any) -> list:
        h = client.header(round, uuid.uuid4().hex, **header)
        return upload_messages(self.pb, h, tensor_chunks(self.pb, self.manifest, tensors))

    def complete(self, r: int, base: Model, done: dict[int, dict[str, np.ndarray]] | None = None) -> Model:
        """Honest uploads from the clients not in ``done``; the next model must be the numpy
        re-computation of the uploads (each update clipped to ``CLIP``), weighted by NUM_SAMPLES."""
        uploads = dict(done or {})
        for c in self.clients:
            if c.index not in uploads:
                uploads[c.index] = self.honest(base, c)
                assert c.upload(self.messages(c, r, uploads[c.index])).accepted
        new = self.a.listener.wait(r + 1)
        floats = [k for k, v in base.tensors.items() if v.dtype.kind == "f"]
        scale = {}
        for i, x in uploads.items():
            norm = math.sqrt(sum(float(((x[k].astype(np.float64) - base.tensors[k]) ** 2).sum()) for k in floats))
            scale[i] = min(1.0, CLIP / norm)
        for k, got in new.tensors.items():
            acc = 0.0
            for i, x in uploads.items():
                ref, v = base.tensors[k].astype(np.float64), x[k].astype(np.float64)
                acc = acc + NUM_SAMPLES[i] * ((ref + scale[i] * (v - ref)) if k in floats else v)
            want = acc / sum(NUM_SAMPLES)
            if k in floats:
                np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-5, atol=1e-6, err_msg=k)
            else:
                np.testing.assert_array_equal(got, np.round(want).astype(got.dtype))
        assert self.server.alive(), self.server.log_tail()
        return new


@pytest.fixture(scope="module")
def fed(stubs, tmp_path_factory: pytest.TempPathFactory):
    pb, pb_grpc = stubs
    work = tmp_path_factory.mktemp("attack-server")
    token_file = work / "token"
    token_file.write_text(TOKEN)
    with serving(lambda server: Fed(pb, pb_grpc, server), CONFIG, work, ["--token-file", str(token_file)]) as f:
        yield f


def expect(err: grpc.RpcError, code: grpc.StatusCode, *fragments: str) -> None:
    expect_status(err, code, *fragments, max_details=300)  # details are bounded


def no_message(call: Any) -> grpc.RpcError:
    """The error of a server stream that must end before its first message."""
    return call_error(lambda: next(iter(call)))


def reports_text(fed: Fed) -> str:
    p = fed.server.out_dir / "reports.jsonl"
    return p.read_text() if p.exists() else ""


# --------------------------------------------------------------------------- outsiders


def test_outsider_without_credentials_gets_nothing(fed: Fed) -> None:
    r, base = fed.open_round()
    outsider = fed.stranger("outsider", index=0)
    try:
        for token in ("", "wrong-token"):
            expect(call_error(lambda t=token: outsider.join(token=t)), Code.UNAUTHENTICATED, "token")
        forged = "0." + "0" * 64
        for md in ((), ((CREDENTIAL_KEY, forged),), ((CREDENTIAL_KEY, "garbage"),)):
            # the joined clients' ids, with no or a forged credential
            expect(no_message(outsider.broadcasts(fed.a.client_id, metadata=md)), Code.UNAUTHENTICATED)
            poisoned = fed.messages(fed.a, r, {k: v + 1000 for k, v in base.tensors.items()})
            expect(
                call_error(lambda m=md, p=poisoned: fed.a.upload(p, metadata=m)),
                Code.UNAUTHENTICATED,
            )
            err = call_error(
                lambda m=md: fed.a.report(round=r, metrics={"pm_accuracy": FORGED, "pm_test_samples": 10}, metadata=m)
            )
            expect(err, Code.UNAUTHENTICATED)
    finally:
        outsider.close()
    fed.complete(r, base)
    assert str(FORGED) not in reports_text(fed)


def test_a_client_cannot_speak_for_another(fed: Fed) -> None:
    r, base = fed.open_round()
    as_b = ((CREDENTIAL_KEY, fed.b.credential),)  # b's own, valid credential, used under a's id
    expect(no_message(fed.b.broadcasts(fed.a.client_id)), Code.PERMISSION_DENIED, "another client")
    poisoned = {k: v + 1000 for k, v in base.tensors.items()}
    expect(call_error(lambda: fed.a.upload(fed.messages(fed.a, r, poisoned), metadata=as_b)), Code.PERMISSION_DENIED)
    err = call_error(lambda: fed.a.report(round=r, metrics={"pm_accuracy": FORGED}, metadata=as_b))
    expect(err, Code.PERMISSION_DENIED)
    # a's own upload is still its first one: accepted
    fed.complete(r, base)
    assert str(FORGED) not in reports_text(fed)


def test_an_index_cannot_be_squatted(fed: Fed) -> None:
    r, base = fed.open_round()
    squatter = fed.stranger("squatter", index=0)
    squatter.token = TOKEN
    twin = fed.stranger(fed.a.client_id, index=0)  # a's very id, with the token but not its credential
    twin.token = TOKEN
    try:
        expect(call_error(lambda: squatter.join()), Code.ALREADY_EXISTS, "client_index 0")
        expect(call_error(lambda: twin.join()), Code.PERMISSION_DENIED, "session credential")
        assert squatter.credential == twin.credential == ""
        # a itself re-joins with its credential (a reconnect) and keeps it
        before = fed.a.credential
        reply = fed.a.join(metadata=fed.a.metadata())
        assert reply.session_credential == before
    finally:
        squatter.close()
        twin.close()
    fed.complete(r, base)


def test_oversized_ids_are_refused(fed: Fed) -> None:
    r, base = fed.open_round()
    big = fed.stranger("x" * 200_000, index=1)
    big.token = TOKEN
    try:
        expect(call_error(lambda: big.join()), Code.INVALID_ARGUMENT, "client_id")
        expect(no_message(fed.a.broadcasts("y" * 100_000)), Code.INVALID_ARGUMENT, "client_id")
    finally:
        big.close()
    fed.complete(r, base)  # every later broadcast header still fits


# --------------------------------------------------------------------------- resources and malformed input


def test_a_stalled_upload_is_cut_and_rolled_back(fed: Fed) -> None:
    r, base = fed.open_round()
    msgs = fed.messages(fed.a, r, {k: v + 1000 for k, v in base.tensors.items()})
    release = threading.Event()

    def stalling():
        yield from msgs[:3]  # header and two chunks, then nothing
        release.wait(60)

    try:
        err = call_error(lambda: fed.a.upload_future(stalling(), timeout=60).result())
    finally:
        release.set()
    expect(err, Code.DEADLINE_EXCEEDED, "cut off")
    fed.complete(r, base)  # a's slot was freed and nothing of the stalled upload stayed


def test_malformed_messages_get_a_short_fixed_status(fed: Fed) -> None:
    r, base = fed.open_round()
    ch = fed.a.channel
    md = fed.a.metadata()
    junk = b"\x0a\xff\xff\xff\xff\xff\xff"  # a length prefix past the end
    for method in ("Join", "Report"):
        call = ch.unary_unary(f"/wafl.v1.Federation/{method}", request_serializer=None, response_deserializer=None)
        expect(call_error(lambda c=call: c(junk, timeout=10, metadata=md)), Code.INVALID_ARGUMENT, "malformed message")
    stream = ch.unary_stream("/wafl.v1.Federation/Broadcasts", request_serializer=None, response_deserializer=None)
    expect(no_message(stream(junk, timeout=10, metadata=md)), Code.INVALID_ARGUMENT, "malformed message")
    upload = ch.stream_unary("/wafl.v1.Federation/Upload", request_serializer=None, response_deserializer=None)
    expect(call_error(lambda: upload(iter([junk]), timeout=10, metadata=md)), Code.INVALID_ARGUMENT, "malformed")
    fed.complete(r, base)


def test_report_rate_is_bounded(fed: Fed) -> None:
    r, base = fed.open_round()
    codes = []
    for _ in range(60):
        try:
            fed.b.report(round=r)  # no metrics: stored as a bare report line
            codes.append(Code.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    assert set(codes) <= {Code.OK, Code.RESOURCE_EXHAUSTED}
    assert Code.RESOURCE_EXHAUSTED in codes and codes[0] == Code.OK
    fed.complete(r, base)


# --------------------------------------------------------------------------- poisoning


def test_poisoning_by_magnitude_moves_the_model_no_further_than_the_bound(fed: Fed) -> None:
    r, base = fed.open_round()

    def shifted(by: float) -> dict[str, np.ndarray]:
        return {
            k: (v + np.asarray(by, v.dtype)).astype(v.dtype) if v.dtype.kind == "f" else v
            for k, v in base.tensors.items()
        }

    # beyond what float32 can average (its squared norm overflows): refused, nothing recorded
    expect(call_error(lambda: fed.a.upload(fed.messages(fed.a, r, shifted(1e30)))), Code.INVALID_ARGUMENT, "L2 norm")
    poisoned = shifted(1e12)
    assert fed.a.upload(fed.messages(fed.a, r, poisoned)).accepted  # finite: accepted, then clipped
    new = fed.complete(r, base, done={0: poisoned})
    floats = [k for k, v in base.tensors.items() if v.dtype.kind == "f"]
    moved = math.sqrt(sum(float(((new.tensors[k].astype(np.float64) - base.tensors[k]) ** 2).sum()) for k in floats))
    assert moved <= CLIP * (1 + 1e-4)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_poisoning_by_metrics_is_refused(fed: Fed, value: float) -> None:
    r, base = fed.open_round()
    metric = "train_loss" if value != -1.0 else "pm_accuracy"
    err = call_error(lambda: fed.a.upload(fed.messages(fed.a, r, fed.honest(base, fed.a), metrics={metric: value})))
    expect(err, Code.INVALID_ARGUMENT, metric)
    expect(call_error(lambda: fed.a.report(round=r, metrics={"pm_accuracy": value})), Code.INVALID_ARGUMENT)
    fed.a.report(round=r, metrics={"pm_accuracy": 0.5})  # an honest report: the file holds a line (run alone too)
    fed.complete(r, base)
    for name in ("results.jsonl", "reports.jsonl"):
        for line in (fed.server.out_dir / name).read_text().splitlines():
            json.loads(line, parse_constant=_no_constant)


def _no_constant(c: str) -> None:
    pytest.fail(f"a JSON line holds {c}")


def test_fuzzed_upload_streams_leave_the_honest_aggregate(fed: Fed) -> None:
    """A bounded number of randomly mutated upload streams (bytes flipped after the header,
    messages dropped, repeated, swapped or cut off): each one refused, the server alive, and the
    next model exactly the honest aggregate."""
    r, base = fed.open_round()
    rng = random.Random(12)
    upload = fed.a.channel.stream_unary(
        "/wafl.v1.Federation/Upload", request_serializer=None, response_deserializer=fed.pb.UploadReply.FromString
    )
    raw = [m.SerializeToString() for m in fed.messages(fed.a, r, fed.honest(base, fed.a))]
    for trial in range(30):
        msgs = list(raw)
        kind = trial % 5
        if kind == 0:  # bytes flipped in one message after the header
            i = rng.randrange(1, len(msgs))
            b = bytearray(msgs[i])
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] ^= rng.randrange(1, 256)
            msgs[i] = bytes(b)
        elif kind == 1:
            del msgs[rng.randrange(1, len(msgs))]
        elif kind == 2:
            i = rng.randrange(1, len(msgs))
            msgs.insert(i, msgs[i])
        elif kind == 3:
            i, j = sorted(rng.sample(range(1, len(msgs) - 1), 2))
            msgs[i], msgs[j] = msgs[j], msgs[i]
        else:
            msgs = msgs[: rng.randrange(1, len(msgs))]
        err = call_error(lambda m=msgs: upload(iter(m), timeout=30, metadata=fed.a.metadata()))
        assert err.code() in (Code.INVALID_ARGUMENT, Code.DATA_LOSS, Code.RESOURCE_EXHAUSTED), (
            trial,
            err.code(),
            err.details(),
        )
        assert fed.server.alive(), fed.server.log_tail()
    deadline = time.monotonic() + 30
    while True:  # the last refused stream may still be draining on the server
        try:
            fed.complete(r, base)
            break
        except grpc.RpcError as e:
            if e.code() != Code.ALREADY_EXISTS or time.monotonic() > deadline:
                raise
            time.sleep(0.2)

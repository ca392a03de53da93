"""Exactly-once uploads and the duties around them, from the independent client over real sockets.

An upload is committed once the server has checked its trailer (the commit point); a retry under
the same idempotency key is then answered with the original reply for the rest of the run,
whatever became of the first reply: dropped by the client, the call cancelled after its trailer,
the round closed since, the run over. Before the commit point nothing of an upload remains and a
retry is a new upload. Each case below ends its round with the other client's upload and checks
that the next model is the FedAvg of exactly one upload per client. Also: metrics are declared
and validated, ``train_loss`` is weighted by samples, a Report of another run is refused and not
stored, and the server ends the run once every client sent its final Report.
"""

from __future__ import annotations

import functools
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from independent_client import (
    BroadcastListener,
    IndependentClient,
    Model,
    ServerProcess,
    call_error,
    expect_status,
    numpy_dtype,
    tensor_chunks,
    upload_messages,
)
from support.federation import JoinedFederation, serving

NUM_SAMPLES = (30, 70)
ROUNDS = 6  # the rounds the tests below consume, in order; the last one ends the run
CONFIG = {
    "num_clients": 2,
    "rounds": ROUNDS,
    "round_deadline_s": 120,
    "join_timeout_s": 60,
    "local_epochs": 1,
    "eval_every": 0,
    "checkpoint": False,
    "seed": 0,
}
Code = grpc.StatusCode


class Run(JoinedFederation):
    def __init__(self, pb: Any, pb_grpc: Any, server: ServerProcess) -> None:
        super().__init__(pb, pb_grpc, server, "once", NUM_SAMPLES)

    def model(self, round: int) -> Model:
        m = self.a.listener.wait(round, timeout=120)
        assert m.trailer_crc == m.computed_crc
        return m

    def update(self, base: Model, c: IndependentClient) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([base.round, c.index, 5])
        return {
            k: (v + rng.standard_normal(v.shape).astype(v.dtype) * 0.01).astype(v.dtype)
            for k, v in base.tensors.items()
        }

    def messages(
        self, c: IndependentClient, round: int, tensors: dict[str, np.ndarray], key: str, **fields: Any
    ) -> list:
        return upload_messages(self.pb, c.header(round, key, **fields), tensor_chunks(self.pb, self.manifest, tensors))

    def nbytes(self) -> int:
        return sum(int(np.prod(s.shape)) * numpy_dtype(self.pb, s.dtype).itemsize for s in self.manifest)

    def check_fedavg(self, round: int, uploads: dict[int, dict[str, np.ndarray]]) -> Model:
        """The model that round ``round`` made is the FedAvg of exactly these uploads."""
        new = self.model(round + 1)
        total = float(sum(NUM_SAMPLES))
        for name, got in new.tensors.items():
            acc = sum(NUM_SAMPLES[i] * uploads[i][name].astype(np.float64) for i in uploads)
            np.testing.assert_allclose(got, (acc / total).astype(got.dtype), rtol=1e-6, atol=1e-7, err_msg=name)
        return new

    def accepted_events(self, c: IndependentClient, round: int) -> int:
        return sum(
            1 for e in self.server.events("upload.accepted") if e["client"] == c.client_id and e["round"] == round
        )


@pytest.fixture(scope="module")
def run(stubs: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory):
    pb, pb_grpc = stubs
    # the last test ends the run: the server is not expected to outlive the module
    with serving(
        lambda server: Run(pb, pb_grpc, server),
        CONFIG,
        tmp_path_factory.mktemp("once-server"),
        first_round=False,
        must_survive=False,
    ) as r:
        yield r


expect = expect_status


# --------------------------------------------------------------------------- refusals (no round used)


def test_upload_needs_an_idempotency_key_and_declared_metrics(run: Run) -> None:
    base = run.model(1)
    t = run.update(base, run.a)
    err = call_error(lambda: run.a.upload(run.messages(run.a, 1, t, "")))
    expect(err, Code.INVALID_ARGUMENT, "idempotency_key")
    err = call_error(lambda: run.a.upload(run.messages(run.a, 1, t, "k" * 129)))
    expect(err, Code.INVALID_ARGUMENT, "idempotency_key")
    err = call_error(lambda: run.a.upload(run.messages(run.a, 1, t, uuid.uuid4().hex, metrics={"accuracy": 0.5})))
    expect(err, Code.INVALID_ARGUMENT, "'accuracy'", "not declared", "train_loss")
    for bad in ({"train_loss": float("nan")}, {"train_steps": 2.5}, {"pm_accuracy": 1.5}):
        msgs = run.messages(run.a, 1, t, uuid.uuid4().hex, metrics=bad)
        err = call_error(functools.partial(run.a.upload, msgs))
        expect(err, Code.INVALID_ARGUMENT, repr(next(iter(bad))))


def test_reports_of_another_run_or_with_undeclared_metrics_are_refused_and_not_stored(run: Run) -> None:
    a = run.a
    err = call_error(lambda: a.report(run_id="another-run", round=1, metrics={"pm_accuracy": 0.5}))
    expect(err, Code.FAILED_PRECONDITION, "'another-run'")
    err = call_error(lambda: a.report(round=1, metrics={"loss": 0.5}))
    expect(err, Code.INVALID_ARGUMENT, "'loss'", "not declared", "pm_accuracy")
    err = call_error(lambda: a.report(round=1, metrics={"pm_accuracy": -0.1}))
    expect(err, Code.INVALID_ARGUMENT, "'pm_accuracy'")
    err = call_error(lambda: a.report(round=ROUNDS + 1, metrics={"pm_accuracy": 0.5}))
    expect(err, Code.INVALID_ARGUMENT, f"round {ROUNDS + 1}")
    reports = run.server.out_dir / "reports.jsonl"
    assert not reports.exists() or a.client_id not in reports.read_text()


# --------------------------------------------------------------------------- one round each


def test_lost_reply_retry_is_answered_ok_also_after_the_round_closed(run: Run) -> None:
    r, base = 1, run.model(1)
    ta, tb = run.update(base, run.a), run.update(base, run.b)
    first_a = run.messages(run.a, r, ta, uuid.uuid4().hex, metrics={"train_loss": 1.0})
    reply = run.a.upload(first_a)  # the client "loses" this reply and retries
    again = run.a.upload(first_a)
    assert (again.accepted, again.round, again.bytes_received) == (True, r, run.nbytes())
    assert (reply.round, reply.bytes_received) == (again.round, again.bytes_received)
    first_b = run.messages(run.b, r, tb, uuid.uuid4().hex, metrics={"train_loss": 3.0})
    run.b.upload(first_b)  # closes the round
    run.check_fedavg(r, {0: ta, 1: tb})
    for c, msgs in ((run.a, first_a), (run.b, first_b)):  # the round is closed: still the original outcome
        late = c.upload(msgs)
        assert (late.accepted, late.round, late.bytes_received) == (True, r, run.nbytes())
    # a different upload (new key) for the same round is refused
    err = call_error(lambda: run.a.upload(run.messages(run.a, r, ta, uuid.uuid4().hex)))
    assert err.code() in (Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION), err
    assert run.accepted_events(run.a, r) == run.accepted_events(run.b, r) == 1
    # results: the mean training loss over samples, (30 * 1 + 70 * 3) / 100
    row = json.loads((run.server.out_dir / "results.jsonl").read_text().splitlines()[0])
    assert row["round"] == r and row["train_loss"] == pytest.approx(2.4)


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_cancelled_after_trailer_retry_is_answered_ok_and_counted_once(run: Run, delay_s: float) -> None:
    base = max(run.a.listener.models.values(), key=lambda m: m.round)
    r = base.round
    ta, tb = run.update(base, run.a), run.update(base, run.b)
    msgs = run.messages(run.a, r, ta, uuid.uuid4().hex)
    sent = threading.Event()

    def stream():
        yield from msgs
        sent.set()

    future = run.a.upload_future(stream())
    assert sent.wait(30)
    time.sleep(delay_s)
    future.cancel()  # the client gives up on the reply; committed or rolled back, it cannot tell
    retry = run.a.upload(msgs)
    assert (retry.accepted, retry.round, retry.bytes_received) == (True, r, run.nbytes())
    run.b.upload(run.messages(run.b, r, tb, uuid.uuid4().hex))
    run.check_fedavg(r, {0: ta, 1: tb})
    assert run.accepted_events(run.a, r) == 1


@pytest.mark.parametrize("first", ["cancelled", "completed"])
def test_retry_while_the_first_attempt_still_streams_waits_for_its_outcome(run: Run, first: str) -> None:
    base = max(run.a.listener.models.values(), key=lambda m: m.round)
    r = base.round
    ta, tb = run.update(base, run.a), run.update(base, run.b)
    msgs = run.messages(run.a, r, ta, uuid.uuid4().hex)
    half = len(msgs) // 2
    halfway, release = threading.Event(), threading.Event()

    def stalled():
        yield from msgs[:half]
        halfway.set()
        release.wait(60)
        yield from msgs[half:]

    original = run.a.upload_future(stalled())
    try:
        assert halfway.wait(30)
        time.sleep(0.5)  # the server has admitted the first attempt
        retry = run.a.upload_future(iter(msgs))  # waits for the first attempt's outcome
        time.sleep(0.5)
        if first == "cancelled":
            original.cancel()
        release.set()
        reply = retry.result(timeout=60)
    finally:
        release.set()
    assert (reply.accepted, reply.round, reply.bytes_received) == (True, r, run.nbytes())
    if first == "completed":
        done = original.result(timeout=60)
        assert (done.round, done.bytes_received) == (reply.round, reply.bytes_received)
    run.b.upload(run.messages(run.b, r, tb, uuid.uuid4().hex))
    run.check_fedavg(r, {0: ta, 1: tb})
    assert run.accepted_events(run.a, r) == 1


def test_retry_after_the_run_ended_and_final_reports_end_the_server(run: Run) -> None:
    base = max(run.a.listener.models.values(), key=lambda m: m.round)
    r = base.round
    assert r == ROUNDS, f"the tests above should have used {ROUNDS - 1} rounds, not {r - 1}"
    ta, tb = run.update(base, run.a), run.update(base, run.b)
    msgs = run.messages(run.a, r, ta, uuid.uuid4().hex)
    run.a.upload(msgs)
    run.b.upload(run.messages(run.b, r, tb, uuid.uuid4().hex))
    final = run.check_fedavg(r, {0: ta, 1: tb})
    assert final.final and not final.train and final.round == ROUNDS + 1
    late = run.a.upload(msgs)  # the run is over: a retry still gets the original outcome
    assert (late.accepted, late.round, late.bytes_received) == (True, r, run.nbytes())
    err = call_error(lambda: run.a.upload(run.messages(run.a, r, ta, uuid.uuid4().hex)))
    expect(err, Code.FAILED_PRECONDITION)
    for c in run.clients:
        c.report(round=ROUNDS, metrics={"final": 1.0, "global_crc32": float(final.computed_crc)})
    assert run.server.proc.wait(timeout=60) == 0, run.server.log_tail()
    assert run.server.events("final_reports.missing") == []
    reports = [json.loads(line) for line in (run.server.out_dir / "reports.jsonl").read_text().splitlines()]
    assert {x["client"] for x in reports if x.get("final") == 1.0} == {c.client_id for c in run.clients}


# --------------------------------------------------------------------------- a resumed server


def test_a_resumed_server_answers_retries_of_uploads_committed_before(stubs: tuple[Any, Any], tmp_path: Path) -> None:
    pb, pb_grpc = stubs
    cfg = {**CONFIG, "rounds": 3, "checkpoint": True}
    first = ServerProcess(cfg, tmp_path / "first")
    second = r1 = None
    again: list[IndependentClient] = []
    try:
        r1 = Run(pb, pb_grpc, first)
        base = r1.model(1)
        ta, tb = r1.update(base, r1.a), r1.update(base, r1.b)
        msgs_a = r1.messages(r1.a, 1, ta, uuid.uuid4().hex)
        r1.a.upload(msgs_a)
        r1.b.upload(r1.messages(r1.b, 1, tb, uuid.uuid4().hex))
        base = r1.check_fedavg(1, {0: ta, 1: tb})  # round 1 is checkpointed before model 2 goes out
        ta2 = r1.update(base, r1.a)
        msgs_a2 = r1.messages(r1.a, 2, ta2, uuid.uuid4().hex)
        r1.a.upload(msgs_a2)  # committed to round 2, which the server will not finish
        first.proc.kill()
        first.proc.wait(timeout=30)
        second = ServerProcess(cfg, tmp_path / "second", extra_args=["--resume", "--out", str(first.out_dir)])
        assert second.run_id == first.run_id
        for c in r1.clients:
            c2 = IndependentClient(pb, pb_grpc, second.address, c.client_id, c.index, c.num_samples)
            c2.credential = c.credential  # a registered index re-joins with its credential
            c2.reply = c2.join(metadata=c2.metadata())
            manifest = list(c2.reply.manifest)
            c2.listener = BroadcastListener(pb, c2.stub, c2.reply.run_id, c2.client_id, manifest, c2.metadata())
            again.append(c2)
        late = again[0].upload(msgs_a)  # the retry of an upload to a round the first server finished
        assert (late.accepted, late.round, late.bytes_received) == (True, 1, r1.nbytes())
        # round 2 was not finished: its upload is gone, and its retry is a new upload
        model2 = again[0].listener.wait(2, timeout=120)
        assert model2.computed_crc == base.computed_crc  # the checkpointed model, sent again
        retry = again[0].upload(msgs_a2)
        assert (retry.accepted, retry.round) == (True, 2)
        tb2 = r1.update(base, r1.b)
        again[1].upload(r1.messages(again[1], 2, tb2, uuid.uuid4().hex))
        model3 = again[0].listener.wait(3, timeout=120)
        total = float(sum(NUM_SAMPLES))
        for name, got in model3.tensors.items():
            acc = NUM_SAMPLES[0] * ta2[name].astype(np.float64) + NUM_SAMPLES[1] * tb2[name].astype(np.float64)
            np.testing.assert_allclose(got, (acc / total).astype(got.dtype), rtol=1e-6, atol=1e-7, err_msg=name)
    finally:
        for c in (r1.clients if r1 is not None else []) + again:
            c.close()
        first.stop()
        if second is not None:
            second.stop()

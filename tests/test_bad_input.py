"""Bad input over the wire: a precise gRPC status, the global model untouched, the server alive.

One real server process is shared by the module (``num_clients=2``, both selected every round);
every case below uses one round of it:

1. a joined, selected client sends the bad request and the test checks the exact status code
   and that the details name the problem;
2. both clients then upload valid updates (deterministic perturbations of the broadcast model)
   and the next broadcast must equal the numpy FedAvg of exactly those valid uploads, so a bad
   upload that leaked into the aggregate (or a partial one that was not rolled back) shows;
3. the server process must still be running.

The bad uploads carry values far from the model (``+1000``) wherever they are otherwise valid,
so that any trace of them in the aggregate is large.

The client side uses only stubs generated from ``protos/wafl/v1/federation.proto`` and plain
``grpc`` (see ``independent_client.py``); neither module imports anything from wafl.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
import zlib
from typing import Any

import grpc
import numpy as np
import pytest
from independent_client import (
    CHUNK_LIMIT,
    MIB,
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

NUM_SAMPLES = (30, 70)  # declared at Join by client 0 and client 1: unequal FedAvg weights
CONFIG = {
    "num_clients": 2,
    "rounds": 60,  # more than the cases below use; each case consumes one round
    "round_deadline_s": 90,
    "join_timeout_s": 60,
    "local_epochs": 1,
    "eval_every": 0,
    "checkpoint": False,
    "seed": 0,
}
POISON = 1000.0
Code = grpc.StatusCode


# --------------------------------------------------------------------------- fixtures


class Federation(JoinedFederation):
    """The shared server, two joined clients and the round bookkeeping of the tests."""

    def __init__(self, pb: Any, pb_grpc: Any, server: ServerProcess) -> None:
        super().__init__(pb, pb_grpc, server, "indep", NUM_SAMPLES)
        assert all(c.reply.run_id == server.run_id for c in self.clients)
        self.model_bytes = sum(len(c.data) for c in tensor_chunks(pb, self.manifest, self.zero_tensors()))
        self.clean = True

    def zero_tensors(self) -> dict[str, np.ndarray]:
        return {s.name: np.zeros(tuple(s.shape), dtype=numpy_dtype(self.pb, s.dtype)) for s in self.manifest}

    def key(self) -> str:
        return uuid.uuid4().hex

    # -- models
    def valid_update(self, base: Model, client: IndependentClient, round: int) -> dict[str, np.ndarray]:
        """A deterministic, client- and round-specific perturbation of the broadcast model."""
        rng = np.random.default_rng([round, client.index, 17])
        return {
            k: (v + (rng.standard_normal(v.shape) * 0.01).astype(v.dtype)).astype(v.dtype)
            for k, v in base.tensors.items()
        }

    def poisoned(self, base: Model) -> dict[str, np.ndarray]:
        return {k: (v + np.asarray(POISON, dtype=v.dtype)).astype(v.dtype) for k, v in base.tensors.items()}

    def chunks(self, tensors: dict[str, np.ndarray], chunk_bytes: int = 64 << 10) -> list[Any]:
        return tensor_chunks(self.pb, self.manifest, tensors, chunk_bytes)

    # -- rounds
    def open_round(self) -> tuple[int, Model]:
        """The round now open and its broadcast model (both clients selected)."""
        if not self.clean:
            self._resync()
        self.clean = False
        assert self.server.alive(), self.server.log_tail()
        model = self.a.listener.latest()
        assert not model.final, "the run ended: raise CONFIG['rounds']"
        assert model.train and all(c.listener.latest().train for c in self.clients)
        return model.round, model

    def _resync(self) -> None:
        """After a failed test: finish whatever round is open so the next test starts fresh."""
        model = self.a.listener.latest()
        for c in self.clients:
            try:
                c.upload(
                    upload_messages(
                        self.pb,
                        c.header(model.round, self.key()),
                        self.chunks(self.valid_update(model, c, model.round)),
                    )
                )
            except grpc.RpcError:
                pass
        self.a.listener.wait(model.round + 1, timeout=2 * CONFIG["round_deadline_s"])

    def upload_valid(
        self, client: IndependentClient, round: int, base: Model, retry_streaming_s: float = 0.0
    ) -> dict[str, np.ndarray]:
        tensors = self.valid_update(base, client, round)
        msgs = upload_messages(self.pb, client.header(round, self.key()), self.chunks(tensors))
        deadline = time.monotonic() + retry_streaming_s
        while True:
            try:
                reply = client.upload(msgs)
                break
            except grpc.RpcError as e:
                # right after a cancelled stream the server may not have seen the cancellation yet
                if (
                    e.code() == Code.ALREADY_EXISTS
                    and "streaming" in (e.details() or "")
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.1)
                    continue
                raise
        assert reply.accepted
        assert reply.round == round
        assert reply.bytes_received == self.model_bytes
        return tensors

    def complete_round(
        self,
        round: int,
        base: Model,
        done: dict[int, dict[str, np.ndarray]] | None = None,
        retry_streaming_s: float = 0.0,
    ) -> Model:
        """Valid uploads from the clients not in ``done``; checks the next model is their FedAvg."""
        uploads = dict(done or {})
        for c in self.clients:
            if c.index not in uploads:
                uploads[c.index] = self.upload_valid(c, round, base, retry_streaming_s)
        new = self.a.listener.wait(round + 1)
        other = self.b.listener.wait(round + 1)
        assert new.round == round + 1 and not new.final
        assert new.trailer_crc == new.computed_crc
        assert other.computed_crc == new.computed_crc
        total = float(sum(NUM_SAMPLES))
        for name, got in new.tensors.items():
            acc = sum(NUM_SAMPLES[i] * uploads[i][name].astype(np.float64) for i in uploads)
            expected = (acc / total).astype(got.dtype)
            assert got.shape == expected.shape
            assert np.allclose(got, expected, rtol=1e-6, atol=1e-7), (
                f"{name}: max |diff| {np.abs(got.astype(np.float64) - expected).max()}"
            )
        assert self.server.alive(), self.server.log_tail()
        self.clean = True
        return new

    def close(self) -> None:
        for c in self.clients:
            c.close()


@pytest.fixture(scope="module")
def fed(stubs, tmp_path_factory: pytest.TempPathFactory):
    pb, pb_grpc = stubs
    with serving(
        lambda server: Federation(pb, pb_grpc, server), CONFIG, tmp_path_factory.mktemp("bad-input-server")
    ) as f:
        yield f


def first_index(chunks: list[Any], name: str) -> int:
    return next(i for i, c in enumerate(chunks) if c.name == name)


# --------------------------------------------------------------------------- service basics


def test_health_reports_serving(fed: Federation) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(fed.a.channel)
    for service in ("", "wafl.v1.Federation"):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
    err = call_error(lambda: stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10))
    assert err.code() == Code.NOT_FOUND


def test_reflection_lists_federation(fed: Federation) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(fed.a.channel)
    responses = list(
        stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    )
    assert len(responses) == 1
    names = {s.name for s in responses[0].list_services_response.service}
    assert "wafl.v1.Federation" in names
    # the service's descriptor can be fetched by symbol, as generic tools (grpcurl) do
    responses = list(
        stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="wafl.v1.Federation")]), timeout=10
        )
    )
    assert responses[0].WhichOneof("message_response") == "file_descriptor_response"
    assert responses[0].file_descriptor_response.file_descriptor_proto


def test_broadcast_is_well_formed_and_valid_round_completes(fed: Federation) -> None:
    r, base = fed.open_round()
    names = [s.name for s in fed.manifest]
    assert len(names) == len(set(names)) > 0
    # chunks in manifest order, each tensor contiguous, no chunk above 1 MiB
    seen = list(dict.fromkeys(base.chunk_names))
    assert seen == names
    assert all(0 < n <= CHUNK_LIMIT for n in base.chunk_sizes)
    assert sum(base.chunk_sizes) == fed.model_bytes
    assert base.trailer_crc == base.computed_crc
    assert all(np.isfinite(v).all() for v in base.tensors.values())
    fed.complete_round(r, base)


# --------------------------------------------------------------------------- Join / Broadcasts


def test_join_unsupported_protocol_version(fed: Federation) -> None:
    r, base = fed.open_round()
    stranger = IndependentClient(fed.pb, fed.pb_grpc, fed.server.address, "stranger-v3", 0, 10)
    try:
        for client in (fed.a, stranger):
            err = call_error(lambda client=client: client.join(protocol_version=3))
            expect_status(err, Code.FAILED_PRECONDITION, "protocol_version 3")
    finally:
        stranger.close()
    fed.complete_round(r, base)


@pytest.mark.parametrize("index", [2, -1, 1000])
def test_join_client_index_out_of_range(fed: Federation, index: int) -> None:
    r, base = fed.open_round()
    stranger = IndependentClient(fed.pb, fed.pb_grpc, fed.server.address, f"stranger-{uuid.uuid4().hex[:6]}", index, 10)
    try:
        err = call_error(lambda: stranger.join())
        expect_status(err, Code.INVALID_ARGUMENT, f"client_index {index}")
        # the refused client got no credential: it cannot subscribe
        assert stranger.credential == ""
        err = call_error(lambda: next(iter(stranger.broadcasts())))
        expect_status(err, Code.UNAUTHENTICATED, "credential")
    finally:
        stranger.close()
    fed.complete_round(r, base)


def test_broadcasts_unknown_client(fed: Federation) -> None:
    r, base = fed.open_round()
    # another client id under a joined client's credential: that credential is not its own
    err = call_error(lambda: next(iter(fed.a.broadcasts("nobody-joined-as-this"))))
    expect_status(err, Code.PERMISSION_DENIED, "another client")
    fed.complete_round(r, base)


# --------------------------------------------------------------------------- bad tensors


@pytest.mark.parametrize("batch", [0, 3], ids=["chunks", "batches"])
def test_upload_wrong_shape(fed: Federation, batch: int) -> None:
    r, base = fed.open_round()
    chunks = fed.chunks(fed.poisoned(base))
    name = fed.manifest[2].name  # earlier tensors are already folded when it is refused
    spec = fed.manifest[2]
    bad_shape = [int(np.prod(spec.shape))]  # same number of elements, different shape
    assert bad_shape != list(spec.shape)
    for c in chunks:
        if c.name == name:
            del c.shape[:]
            c.shape.extend(bad_shape)
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks, batch=batch)))
    expect_status(err, Code.INVALID_ARGUMENT, repr(name), "shape")
    fed.complete_round(r, base)


def test_upload_in_batches_from_a_stock_client_is_accepted(fed: Federation) -> None:
    r, base = fed.open_round()
    tensors = fed.valid_update(base, fed.a, r)
    reply = fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), fed.chunks(tensors), batch=5))
    assert reply.accepted and reply.bytes_received == fed.model_bytes
    fed.complete_round(r, base, done={fed.a.index: tensors})


def test_upload_empty_batch(fed: Federation) -> None:
    r, base = fed.open_round()
    msgs = upload_messages(fed.pb, fed.a.header(r, fed.key()), fed.chunks(fed.poisoned(base)), batch=4)
    msgs.insert(3, fed.pb.UploadMessage(batch=fed.pb.TensorChunkBatch()))
    err = call_error(lambda: fed.a.upload(msgs))
    expect_status(err, Code.INVALID_ARGUMENT, "empty chunk batch")
    fed.complete_round(r, base)


def test_upload_wrong_dtype(fed: Federation) -> None:
    r, base = fed.open_round()
    chunks = fed.chunks(fed.poisoned(base))
    name = fed.manifest[4].name
    assert fed.manifest[4].dtype == fed.pb.FLOAT32
    for c in chunks:
        if c.name == name:
            c.dtype = fed.pb.FLOAT64
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks)))
    expect_status(err, Code.INVALID_ARGUMENT, repr(name), "dtype", "FLOAT64")
    fed.complete_round(r, base)


@pytest.mark.parametrize(("value", "word"), [(math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")])
def test_upload_non_finite_value(fed: Federation, value: float, word: str) -> None:
    r, base = fed.open_round()
    tensors = fed.poisoned(base)
    big = max(fed.manifest, key=lambda s: int(np.prod(s.shape)))
    flat = tensors[big.name].reshape(-1)
    flat[flat.size // 2 + 3] = value  # in a later chunk: earlier chunks were folded already
    chunks = fed.chunks(tensors)
    assert sum(1 for c in chunks if c.name == big.name) > 2
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks)))
    expect_status(err, Code.INVALID_ARGUMENT, repr(big.name), word)
    fed.complete_round(r, base)


def test_upload_tensor_not_in_manifest(fed: Federation) -> None:
    r, base = fed.open_round()
    chunks = fed.chunks(fed.poisoned(base))
    intruder = fed.pb.TensorChunk(
        name="features.99.weight", dtype=fed.pb.FLOAT32, shape=[4], offset=0, data=np.ones(4, "<f4").tobytes()
    )
    chunks.insert(first_index(chunks, fed.manifest[3].name), intruder)
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks)))
    expect_status(err, Code.INVALID_ARGUMENT, "'features.99.weight'", "not in the manifest")
    fed.complete_round(r, base)


@pytest.mark.parametrize("where", ["middle", "last"])
def test_upload_missing_tensor(fed: Federation, where: str) -> None:
    r, base = fed.open_round()
    missing = fed.manifest[3 if where == "middle" else -1].name
    chunks = [c for c in fed.chunks(fed.poisoned(base)) if c.name != missing]
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks)))
    expect_status(err, Code.INVALID_ARGUMENT, "missing")
    if where == "last":
        assert repr(missing) in err.details()
    fed.complete_round(r, base)


def test_upload_missing_tensor_details_name_it(fed: Federation) -> None:
    r, base = fed.open_round()
    missing = fed.manifest[3].name
    chunks = [c for c in fed.chunks(fed.poisoned(base)) if c.name != missing]
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks)))
    details = err.details() or ""
    fed.complete_round(r, base)
    expect_status(err, Code.INVALID_ARGUMENT, "missing")
    assert f"where {missing!r} was expected" in details, details


def test_upload_oversized_chunk(fed: Federation) -> None:
    r, base = fed.open_round()
    chunks = fed.chunks(fed.poisoned(base))
    spec = fed.manifest[4]
    size = CHUNK_LIMIT + 4  # one element over 1 MiB; the message still fits gRPC's limit
    at = first_index(chunks, spec.name)
    chunks = [c for c in chunks if c.name != spec.name]
    chunks.insert(
        at,
        fed.pb.TensorChunk(
            name=spec.name,
            dtype=spec.dtype,
            shape=list(spec.shape),
            offset=0,
            data=np.full(size // 4, POISON, "<f4").tobytes(),
        ),
    )
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks)))
    expect_status(err, Code.RESOURCE_EXHAUSTED, repr(spec.name), str(size))
    fed.complete_round(r, base)


def test_upload_message_over_grpc_limit(fed: Federation) -> None:
    r, base = fed.open_round()
    chunks = fed.chunks(fed.poisoned(base))
    spec = fed.manifest[4]
    at = first_index(chunks, spec.name)
    chunks.insert(
        at,
        fed.pb.TensorChunk(
            name=spec.name,
            dtype=spec.dtype,
            shape=list(spec.shape),
            offset=0,
            data=np.full(MIB // 2, POISON, "<f4").tobytes(),
        ),
    )
    assert len(chunks[at].data) == 2 * MIB  # well over 1 MiB + 64 KiB
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks)))
    assert err.code() == Code.RESOURCE_EXHAUSTED, f"{err.code().name}: {err.details()}"
    fed.complete_round(r, base)


# --------------------------------------------------------------------------- bad headers


def test_upload_unknown_client(fed: Federation) -> None:
    r, base = fed.open_round()
    h = fed.a.header(r, fed.key(), client_id="intruder-never-joined")
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, h, fed.chunks(fed.poisoned(base)))))
    expect_status(err, Code.PERMISSION_DENIED, "another client")
    fed.complete_round(r, base)


def test_upload_stale_round(fed: Federation) -> None:
    r, base = fed.open_round()
    if r < 2:  # a stale round needs a closed one
        base = fed.complete_round(r, base)
        r, base = fed.open_round()
    err = call_error(
        lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r - 1, fed.key()), fed.chunks(fed.poisoned(base))))
    )
    expect_status(err, Code.FAILED_PRECONDITION, f"round {r - 1}", "closed")
    fed.complete_round(r, base)


def test_upload_future_round(fed: Federation) -> None:
    r, base = fed.open_round()
    err = call_error(
        lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r + 1, fed.key()), fed.chunks(fed.poisoned(base))))
    )
    expect_status(err, Code.FAILED_PRECONDITION, f"round {r + 1}", "not opened")
    fed.complete_round(r, base)


# 2**62: more than the client's shard holds (the server rebuilds every shard from the seed); an
# upload may not weigh itself above it, whatever it declared at Join
@pytest.mark.parametrize("num_samples", [0, -5, 2**62])
def test_upload_num_samples_out_of_range(fed: Federation, num_samples: int) -> None:
    r, base = fed.open_round()
    h = fed.a.header(r, fed.key(), num_samples=num_samples)
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, h, fed.chunks(fed.poisoned(base)))))
    expect_status(err, Code.INVALID_ARGUMENT, f"num_samples {num_samples}")
    fed.complete_round(r, base)


def test_upload_duplicate(fed: Federation) -> None:
    r, base = fed.open_round()
    first_key = fed.key()
    tensors = fed.valid_update(base, fed.a, r)
    first = upload_messages(fed.pb, fed.a.header(r, first_key), fed.chunks(tensors))
    reply = fed.a.upload(first)
    assert reply.accepted and reply.round == r and reply.bytes_received == fed.model_bytes
    # a second, different upload from the same client in the same round
    second = upload_messages(fed.pb, fed.a.header(r, fed.key()), fed.chunks(fed.poisoned(base)))
    err = call_error(lambda: fed.a.upload(second))
    expect_status(err, Code.ALREADY_EXISTS, repr(fed.a.client_id), f"round {r}")
    # a retry of the accepted upload (same idempotency key) is answered OK and not counted twice
    again = fed.a.upload(first)
    assert again.accepted and again.round == r
    fed.complete_round(r, base, done={fed.a.index: tensors})


# --------------------------------------------------------------------------- broken transfers


def test_upload_cut_off_half_way(fed: Federation) -> None:
    r, base = fed.open_round()
    msgs = upload_messages(fed.pb, fed.a.header(r, fed.key()), fed.chunks(fed.poisoned(base)))
    half = msgs[: len(msgs) // 2]  # header and about half of the chunks
    assert sum(1 for m in half if m.WhichOneof("kind") == "chunk") > 4
    sent_all = threading.Event()
    release = threading.Event()

    def stream():
        yield from half
        sent_all.set()
        release.wait(30)  # the connection "drops" before anything else is sent

    future = fed.a.upload_future(stream())
    try:
        assert sent_all.wait(10), "the partial upload was not consumed"
        time.sleep(1.0)  # let the server fold what arrived
        assert not future.done(), f"the server answered a half-sent upload: {future.exception()!r}"
        future.cancel()
    finally:
        release.set()
    assert future.cancelled()
    with pytest.raises(grpc.FutureCancelledError):
        future.result(timeout=10)
    # the same client can upload again in the same round; the partial upload left no trace
    fed.complete_round(r, base, retry_streaming_s=10.0)


def test_upload_without_trailer(fed: Federation) -> None:
    r, base = fed.open_round()
    msgs = upload_messages(fed.pb, fed.a.header(r, fed.key()), fed.chunks(fed.poisoned(base)), trailer=False)
    err = call_error(lambda: fed.a.upload(msgs))
    expect_status(err, Code.INVALID_ARGUMENT, "trailer")
    fed.complete_round(r, base)


def test_upload_bad_checksum(fed: Federation) -> None:
    r, base = fed.open_round()
    chunks = fed.chunks(fed.poisoned(base))
    crc = 0
    for c in chunks:
        crc = zlib.crc32(c.data, crc)
    bad = crc ^ 0x1
    err = call_error(lambda: fed.a.upload(upload_messages(fed.pb, fed.a.header(r, fed.key()), chunks, crc=bad)))
    expect_status(err, Code.DATA_LOSS, f"{bad:#010x}", f"{crc:#010x}")
    fed.complete_round(r, base)


def test_server_logged_no_abort(fed: Federation) -> None:
    r, base = fed.open_round()
    fed.complete_round(r, base)
    assert fed.server.alive()
    assert fed.server.events("run.aborted") == []
    rejected = fed.server.events("upload.rejected")
    assert rejected, "the refused uploads should be logged"
    assert all(rec.get("code") for rec in rejected)


def test_a_version_1_client_cannot_join_a_run_whose_uploads_are_differences(stubs, tmp_path) -> None:
    """Version 1 clients ignore ``BroadcastHeader.upload_delta`` and upload whole models: a buffered run,
    which takes differences, refuses them at the join (instead of folding models as if they were
    differences); a version 2 client joins it."""
    pb, pb_grpc = stubs
    config = {**CONFIG, "aggregation": "buffered", "buffer_size": 2}
    server = ServerProcess(config, tmp_path / "server")
    old = IndependentClient(pb, pb_grpc, server.address, "old-client", 0, 10)
    new = IndependentClient(pb, pb_grpc, server.address, "new-client", 1, 10)
    try:
        err = call_error(lambda: old.join())
        expect_status(err, Code.FAILED_PRECONDITION, "protocol_version 1: this run's aggregation (buffered)")
        assert new.join(protocol_version=2).run_id == server.run_id
        assert server.alive(), server.log_tail()
    finally:
        old.close()
        new.close()
        server.stop()

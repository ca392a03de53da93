"""The hosted clients of a worker receive a broadcast into one shared buffer (client/reception.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from wafl.client.reception import SharedReception
from wafl.client.session import ModelAssembler
from wafl.common.codec import ChunkError, RawChunk, manifest_of
from wafl.common.proto import federation_pb2 as pb
from wafl.common.wire import write_transfer


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(700_000, generator=g), "b": torch.randn(7, generator=g)}  # w: 3 chunks of 1 MiB


def _stream(state: dict[str, torch.Tensor], round: int = 3, knowledge: list | None = None) -> list[object]:
    return [
        pb.BroadcastMessage(header=pb.BroadcastHeader(round=round, train=True)),
        *write_transfer(pb.BroadcastMessage, state.items(), knowledge or []),
    ]


def _receive(asms: list[ModelAssembler], streams: list[list[object]]) -> list:
    """Feeds the streams message by message, interleaved, as a worker's event loop would."""
    out: list = [None] * len(asms)
    for step in range(max(len(s) for s in streams)):
        for i, (asm, s) in enumerate(zip(asms, streams)):
            if step < len(s):
                got = asm.feed(s[step])
                if got is not None:
                    out[i] = got
    return out


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_identical_broadcasts_share_one_buffer_and_decode() -> None:
    state = _state(0)
    reception = SharedReception()
    asms = [ModelAssembler(manifest_of(state), reception=reception) for _ in range(3)]
    models = _receive(asms, [_stream(state)] * 3)
    for m in models:
        assert m.round == 3 and m.train
        assert all(torch.equal(m.state[k], state[k]) for k in state)
    assert {_ptr(m.state["w"]) for m in models} == {_ptr(models[0].state["w"])}  # one copy in memory
    assert (reception.shared, reception.alone) == (2, 0)


def test_equal_knowledge_is_decoded_once_and_different_knowledge_alone() -> None:
    state = _state(0)
    same = [pb.ClassKnowledge(class_id=j, count=3, representation=[0.5, j], soft_prediction=[1.0]) for j in range(2)]
    other = [pb.ClassKnowledge(class_id=0, count=3, representation=[0.25, 0.0], soft_prediction=[1.0])]
    reception = SharedReception()
    asms = [ModelAssembler(manifest_of(state), reception=reception) for _ in range(3)]
    models = _receive(
        asms, [_stream(state, knowledge=same), _stream(state, knowledge=other), _stream(state, knowledge=same)]
    )
    assert models[0].knowledge is models[2].knowledge  # one object that the clients read
    assert models[1].knowledge is not models[0].knowledge
    assert torch.equal(models[0].knowledge[1].rep, torch.tensor([0.5, 1.0])) and models[0].knowledge[1].count == 3
    assert list(models[1].knowledge) == [0] and torch.equal(models[1].knowledge[0].rep, torch.tensor([0.25, 0.0]))


def test_a_different_broadcast_goes_on_alone_and_both_are_exact() -> None:
    a, b = _state(0), _state(0)
    b["w"][-5] += 1.0  # differs in the last chunk only
    reception = SharedReception()
    asms = [ModelAssembler(manifest_of(a), reception=reception) for _ in range(3)]
    models = _receive(asms, [_stream(a), _stream(b), _stream(a)])
    for m, want in zip(models, (a, b, a)):
        assert all(torch.equal(m.state[k], want[k]) for k in want)
    assert _ptr(models[0].state["w"]) == _ptr(models[2].state["w"]) != _ptr(models[1].state["w"])
    assert reception.alone == 1


def test_a_corrupted_stream_neither_passes_nor_spoils_the_others() -> None:
    state = _state(1)
    bad = _stream(state)
    i = next(i for i, m in enumerate(bad) if isinstance(m, RawChunk))
    c = bad[i]
    assert isinstance(c, RawChunk)
    data = bytearray(c.data)
    data[10] ^= 0xFF
    bad[i] = dataclasses.replace(c, data=bytes(data))  # the trailer's CRC is the original's
    reception = SharedReception()
    corrupt, good = (
        ModelAssembler(manifest_of(state), reception=reception),
        ModelAssembler(manifest_of(state), reception=reception),
    )
    for m in bad[:-1]:  # the corrupted stream writes its chunks first
        corrupt.feed(m)
    model = None
    for m in _stream(state):
        model = good.feed(m) or model
    assert model is not None and all(torch.equal(model.state[k], state[k]) for k in state)
    assert reception.alone == 1
    with pytest.raises(ChunkError):
        corrupt.feed(bad[-1])


def test_a_late_stream_shares_the_sealed_buffer_and_a_new_round_gets_its_own() -> None:
    state = _state(2)
    reception = SharedReception()
    first = _receive([ModelAssembler(manifest_of(state), reception=reception)], [_stream(state)])[0]
    late = _receive([ModelAssembler(manifest_of(state), reception=reception)], [_stream(state)])[0]
    assert _ptr(late.state["w"]) == _ptr(first.state["w"])
    nxt = _receive([ModelAssembler(manifest_of(state), reception=reception)], [_stream(state, round=4)])[0]
    assert _ptr(nxt.state["w"]) != _ptr(first.state["w"]) and torch.equal(nxt.state["w"], state["w"])


def test_without_shared_reception_every_stream_has_its_own_copy() -> None:
    state = _state(3)
    models = _receive([ModelAssembler(manifest_of(state)) for _ in range(2)], [_stream(state)] * 2)
    assert _ptr(models[0].state["w"]) != _ptr(models[1].state["w"])
    assert all(torch.equal(m.state["w"], state["w"]) for m in models)


def test_same_bytes_compares_bytes_whatever_the_views() -> None:
    import numpy as np
    from wafl.client.reception import same_bytes

    data = np.arange(6, dtype=np.float32)
    raw = bytearray(data.tobytes())
    assert same_bytes(memoryview(raw), memoryview(data).cast("B"))
    assert same_bytes(memoryview(raw)[4:12], bytes(raw[4:12]))
    assert same_bytes(memoryview(b""), b"")
    assert not same_bytes(memoryview(raw), bytes(raw[:-1]))  # lengths differ
    flipped = bytearray(raw)
    flipped[-1] ^= 1
    assert not same_bytes(memoryview(raw), flipped)

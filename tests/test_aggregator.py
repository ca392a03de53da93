"""Streaming aggregation: FedAvg against a numpy re-computation, rollback, server updates."""

import os
import threading

import numpy as np
import pytest
import torch
from wafl.common.algorithms import registry
from wafl.common.codec import ChunkError, iter_chunks, manifest_of
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.aggregation.rule import Rule
from wafl.server.aggregation.spill import RetainedBytes


def make_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(8, 3, 3, 3, generator=g),
        "fc.weight": torch.randn(300, 70, generator=g),  # several chunks at 16 KiB
        "fc.bias": torch.randn(70, generator=g).to(torch.float16),
        "bn.num_batches_tracked": torch.tensor(seed * 10, dtype=torch.int64),
    }


def fold(
    acc: Accumulator, state: dict[str, torch.Tensor], weight: float, chunk_bytes: int = 16384, commit: bool = True
):
    specs = {s.name: s for s in acc.manifest}
    f = acc.begin(weight)
    for c in iter_chunks(state.items(), chunk_bytes):
        f.add(specs[c.name], c)
    if commit:
        f.commit()
    return f


def numpy_fedavg(states, weights):
    total = sum(weights)
    out = {}
    for k in states[0]:
        s = sum(w * states[i][k].double().numpy() for i, w in enumerate(weights)) / total
        out[k] = s
    return out


def test_streamed_fedavg_matches_numpy() -> None:
    states = [make_state(s) for s in range(4)]
    weights = [12, 40, 7, 101]
    acc = Accumulator(manifest_of(states[0]))
    for st, w in zip(states, weights):
        fold(acc, st, w)
    got = acc.mean()
    want = numpy_fedavg(states, weights)
    for k in want:
        assert got[k].dtype == states[0][k].dtype and got[k].shape == states[0][k].shape
        if got[k].is_floating_point():
            tol = 1e-3 if got[k].dtype == torch.float16 else 1e-6
            np.testing.assert_allclose(got[k].double().numpy(), want[k], rtol=tol, atol=tol)
        else:
            assert int(got[k]) == int(np.round(want[k]))


def test_rollback_leaves_no_trace() -> None:
    states = [make_state(s) for s in range(3)]
    acc = Accumulator(manifest_of(states[0]))
    fold(acc, states[0], 5)
    partial = fold(
        acc, {k: (v * 1e6 if v.dtype == torch.float32 else v) for k, v in states[2].items()}, 9, commit=False
    )
    fold(acc, states[1], 3)
    partial.rollback()
    partial.rollback()  # idempotent
    want = numpy_fedavg(states[:2], [5, 3])
    got = acc.mean()
    assert acc.count == 2
    np.testing.assert_allclose(got["fc.weight"].double().numpy(), want["fc.weight"], rtol=1e-6, atol=1e-7)


def test_nan_chunk_is_refused_before_folding() -> None:
    good = make_state(0)
    bad = {k: v.clone() for k, v in good.items()}
    bad["fc.weight"][-1, -1] = float("nan")  # in the last chunk of that tensor
    acc = Accumulator(manifest_of(good))
    f = acc.begin(1.0)
    specs = {s.name: s for s in acc.manifest}
    with pytest.raises(ChunkError, match="NaN"):
        for c in iter_chunks(bad.items(), 16384):
            f.add(specs[c.name], c)
    f.rollback()
    assert all(np.all(s == 0) for s in acc.sums.values())


@pytest.mark.parametrize(("value", "word"), [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")])
def test_a_measured_fold_names_the_non_finite_value_and_rolls_back(value: float, word: str) -> None:
    """With update norms measured (adaptive clipping, the default), the norm's pass also finds a
    non-finite value: the refusal names it (not the norm), and nothing of the upload stays in the sums;
    a finite upload's measured norm is the slow recomputation's."""
    ref, good = make_state(0), make_state(1)
    acc = Accumulator(manifest_of(ref), rule=Rule(adaptive=10.0))
    acc.set_reference(ref)
    specs = {s.name: s for s in acc.manifest}
    bad = {k: v.clone() for k, v in good.items()}
    bad["fc.weight"][-1, -1] = value
    f = acc.begin(1.0)
    with pytest.raises(ChunkError, match=f"'fc.weight': {word} value"):
        for c in iter_chunks(bad.items(), 16384):
            f.add(specs[c.name], c)
    f.rollback()
    assert all(np.all(s == 0) for s in acc.sums.values())
    f = acc.begin(1.0)
    for c in iter_chunks(good.items(), 16384):
        f.add(specs[c.name], c)
    f.commit()
    want = sum(float(((good[k].double() - ref[k].double()) ** 2).sum()) for k in good if good[k].is_floating_point())
    assert f.sq_all == pytest.approx(want, rel=1e-12)
    assert acc.norms == [pytest.approx(want**0.5, rel=1e-12)]


def test_cancel_open_rolls_back_in_flight_folds_and_refuses_more() -> None:
    st = make_state(1)
    acc = Accumulator(manifest_of(st))
    f = fold(acc, st, 2, commit=False)
    assert acc.cancel_open() == 1
    assert all(np.allclose(s, 0) for s in acc.sums.values())
    with pytest.raises(ChunkError) as e:
        f.commit()
    assert e.value.code == "ABORTED"


def test_concurrent_folds_from_threads() -> None:
    states = [make_state(s) for s in range(6)]
    acc = Accumulator(manifest_of(states[0]))
    threads = [threading.Thread(target=fold, args=(acc, st, i + 1, 4096)) for i, st in enumerate(states)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = numpy_fedavg(states, [1, 2, 3, 4, 5, 6])
    np.testing.assert_allclose(acc.mean()["fc.weight"].double().numpy(), want["fc.weight"], rtol=1e-6, atol=1e-7)


def test_fedavgm_server_state_against_hand_computation() -> None:
    algo = registry.resolve("fedavgm", {"server_momentum": 0.5, "server_lr": 1.0})
    w0 = {"w": torch.tensor([1.0, 2.0])}
    m1 = {"w": torch.tensor([0.0, 1.0])}
    out1 = algo.server.finalize(w0, dict(m1), 2)
    # v1 = 0.5*0 + (w0 - m1) = [1, 1]; w1 = w0 - v1 = [0, 1]
    assert torch.allclose(out1["w"], torch.tensor([0.0, 1.0]))
    m2 = {"w": torch.tensor([0.0, 0.0])}
    out2 = algo.server.finalize(out1, dict(m2), 2)
    # v2 = 0.5*[1,1] + ([0,1] - [0,0]) = [0.5, 1.5]; w2 = [0,1] - v2 = [-0.5, -0.5]
    assert torch.allclose(out2["w"], torch.tensor([-0.5, -0.5]))
    saved = algo.server.state_dict()
    fresh = registry.resolve("fedavgm", {"server_momentum": 0.5, "server_lr": 1.0})
    fresh.server.load_state_dict(saved)
    assert torch.equal(fresh.server.velocity["w"], algo.server.velocity["w"])


def test_feddyn_server_state_two_rounds_by_hand() -> None:
    algo = registry.resolve("feddyn", {"alpha": 0.5}, {"num_clients": 4})
    assert algo.server.weight(123) == 1.0  # uniform mean over participants
    w0 = {"w": torch.tensor([1.0])}
    # round 1: participants w_k = 3 and 5 -> mean 4; h = 0 - 0.5/4*((3-1)+(5-1)) = -0.75; w = 4 - (-0.75/0.5) = 5.5
    out1 = algo.server.finalize(w0, {"w": torch.tensor([4.0])}, 2)
    assert torch.allclose(algo.server.h["w"], torch.tensor([-0.75]))
    assert torch.allclose(out1["w"], torch.tensor([5.5]))
    # round 2: one participant w_k = 6.5 -> h = -0.75 - 0.5/4*(6.5-5.5) = -0.875; w = 6.5 + 1.75 = 8.25
    out2 = algo.server.finalize(out1, {"w": torch.tensor([6.5])}, 1)
    assert torch.allclose(algo.server.h["w"], torch.tensor([-0.875]))
    assert torch.allclose(out2["w"], torch.tensor([8.25]))


def test_fold_products_are_float64_for_every_float_dtype() -> None:
    st = make_state(3)
    acc = Accumulator(manifest_of(st))
    fold(acc, st, 0.1)
    for k in ("fc.weight", "fc.bias", "conv.weight"):
        want = st[k].double().numpy().reshape(-1) * 0.1  # float64 product, bit for bit
        np.testing.assert_array_equal(acc.sums[k], want)


def test_reset_accumulator_serves_the_next_round_like_a_fresh_one() -> None:
    states = [make_state(s) for s in range(4)]
    reused = Accumulator(manifest_of(states[0]), retained=RetainedBytes(0))  # every chunk spilled
    fold(reused, states[0], 7)
    fold(reused, states[1], 2, commit=False).rollback()
    reused.reset()
    fresh = Accumulator(manifest_of(states[0]))
    for acc in (reused, fresh):
        fold(acc, states[2], 3)
        partial = fold(acc, states[1], 11, commit=False)  # spill file taken from the pool
        fold(acc, states[3], 5)
        partial.rollback()
    assert reused.count == fresh.count == 2
    for k in fresh.sums:
        np.testing.assert_allclose(reused.sums[k], fresh.sums[k], rtol=1e-12, atol=1e-9)
    # slots went back to the arena and were reused: one file, at most two slots (two folds at once)
    assert reused.spills.in_use == 0 and reused.spills.slots == 2


def test_spill_arena_gives_each_open_upload_its_own_slot_and_trims_between_rounds() -> None:
    states = [make_state(s) for s in range(20)]
    acc = Accumulator(manifest_of(states[0]), retained=RetainedBytes(0))  # every chunk spilled
    acc.spills.keep = 4
    expected = Accumulator(manifest_of(states[0]))
    open_folds = [fold(acc, st, 1 + i, commit=False) for i, st in enumerate(states)]  # 20 uploads in flight
    assert acc.spills.slots == acc.spills.in_use == 20 and len({f.spill.slot for f in open_folds}) == 20
    for i, f in enumerate(open_folds):
        if i % 3:
            f.commit()
            fold(expected, states[i], 1 + i)
        else:
            f.rollback()  # read back from its own slot while the others stay open
    for k in expected.sums:
        np.testing.assert_allclose(acc.sums[k], expected.sums[k], rtol=1e-12, atol=1e-9)
    acc.reset()
    assert acc.spills.in_use == 0 and acc.spills.slots == 4  # the file shrank to the slots kept
    assert os.fstat(acc.spills.file.fileno()).st_size <= 4 * acc.spills.slot_bytes
    fold(acc, states[0], 1, commit=False).rollback()
    assert acc.spills.slots == 4 and not acc.count


def test_reset_refuses_while_an_upload_is_open() -> None:
    st = make_state(0)
    acc = Accumulator(manifest_of(st))
    fold(acc, st, 1, commit=False)
    with pytest.raises(RuntimeError, match="still open"):
        acc.reset()


def test_rollback_data_stays_in_memory_within_the_budget_and_spills_beyond_it() -> None:
    states = [make_state(s) for s in range(4)]
    model_bytes = sum(s.nbytes for s in manifest_of(states[0]))
    budget = RetainedBytes(model_bytes + model_bytes // 2)  # one upload and half of the next
    acc = Accumulator(manifest_of(states[0]), retained=budget)
    expected = Accumulator(manifest_of(states[0]), retained=RetainedBytes(0))
    a = fold(acc, states[0], 2, commit=False)
    b = fold(acc, states[1], 3, commit=False)
    c = fold(acc, states[2], 4, commit=False)
    assert a.spill is None and a.retained == model_bytes  # all in memory: no spill slot taken
    assert b.spill is not None and 0 < b.retained < model_bytes  # in memory up to the budget, the rest spilled
    assert c.spill is not None  # the budget is spent: its large chunks spill (a small one may still fit)
    assert budget.used == a.retained + b.retained + c.retained <= budget.limit
    b.rollback()  # read back from both places
    c.commit()
    a.rollback()
    fold(acc, states[3], 5)
    for st, w in ((states[2], 4), (states[3], 5)):
        fold(expected, st, w)
    for k in expected.sums:
        np.testing.assert_allclose(acc.sums[k], expected.sums[k], rtol=1e-12, atol=1e-9)
    assert budget.used == 0 and acc.spills.in_use == 0  # everything given back


def test_an_upload_keeps_at_most_its_share_in_memory_and_spills_the_rest() -> None:
    states = [make_state(s) for s in range(3)]
    model_bytes = sum(s.nbytes for s in manifest_of(states[0]))
    share = model_bytes // 3
    budget = RetainedBytes(10 * model_bytes, per_upload=share)  # the budget has room, the share does not
    acc = Accumulator(manifest_of(states[0]), retained=budget)
    expected = Accumulator(manifest_of(states[0]), retained=RetainedBytes(0))
    a = fold(acc, states[0], 2, commit=False)
    b = fold(acc, states[1], 3, commit=False)
    for f in (a, b):
        assert f.spill is not None and 0 < f.retained <= share  # its share in memory, the rest spilled
    assert budget.used == a.retained + b.retained
    a.rollback()  # read back from memory and from its slot
    b.commit()
    fold(acc, states[2], 4)
    for st, w in ((states[1], 3), (states[2], 4)):
        fold(expected, st, w)
    for k in expected.sums:
        np.testing.assert_array_equal(acc.sums[k], expected.sums[k])
    small = RetainedBytes.of_mb(256, upload_mb=2)  # the server's defaults: a small model stays in memory
    assert small.per_upload == 2 << 20 and small.take(model_bytes) and model_bytes < 2 << 20


def test_kept_chunks_do_not_follow_a_sender_that_changes_its_buffer() -> None:
    st = make_state(5)
    acc = Accumulator(manifest_of(st))
    specs = {s.name: s for s in acc.manifest}
    f = acc.begin(2.0)
    for c in iter_chunks(st.items(), 16384):  # views of the tensors' own memory
        f.add(specs[c.name], c)
    for v in st.values():
        v.zero_()  # the sender reuses its buffers before the upload ended
    f.rollback()
    assert all(np.all(s == 0) for s in acc.sums.values())


@pytest.mark.parametrize("limit", [0, 1 << 30])
def test_robust_center_reads_kept_uploads_from_memory_or_spill(limit: int) -> None:
    states = [make_state(s) for s in range(5)]
    budget = RetainedBytes(limit)
    acc = Accumulator(manifest_of(states[0]), rule=Rule(center="median"), retained=budget)
    for i, st in enumerate(states):
        fold(acc, st, 1 + i)
    got = acc.center()["fc.weight"].double().numpy()
    want = np.median(np.stack([st["fc.weight"].double().numpy() for st in states]), axis=0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert (budget.used > 0) == (limit > 0)  # kept until the round is aggregated
    acc.reset()
    assert budget.used == 0 and acc.spills.in_use == 0

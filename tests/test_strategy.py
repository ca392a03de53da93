"""The round policies, transport-free: buffered aggregation against a numpy re-computation,
staleness rules, refusals, sync deadlines, and the configuration rules around them."""

import math

import numpy as np
import pytest
import torch
from wafl.common.algorithms import registry
from wafl.common.codec import iter_chunks, manifest_of
from wafl.common.config import ConfigError, load_config
from wafl.common.errors import AlreadyAccepted, Code, Refused
from wafl.server.aggregator import Accumulator
from wafl.server.strategy import BufferedStrategy, RunAborted, SyncStrategy, make_strategy, staleness_function

IDS = ["a", "b", "c"]
SAMPLES = {"a": 10, "b": 30, "c": 20}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 4, generator=g), "b": torch.randn(4, generator=g)}


def make(**overrides):
    cfg = load_config(None, {"num_clients": 3, **overrides})
    manifest = manifest_of(state(0))
    algo = registry.resolve(cfg.algorithm, cfg.params, vars(cfg))
    s = make_strategy(cfg, algo, 10, lambda: Accumulator(manifest))
    for i, cid in enumerate(IDS):
        s.join(cid, i, SAMPLES[cid])
    return s


def upload(s, cid: str, round: int, tensors, key: str = "", now: float = 0.0):
    t = s.open(cid, round, SAMPLES[cid], key or f"{cid}-{round}", now)
    fold = t.collection.accumulator.begin(t.weight)
    specs = {sp.name: sp for sp in t.collection.accumulator.manifest}
    for c in iter_chunks(tensors.items(), 16):
        fold.add(specs[c.name], c)
    fold.commit()
    return t, s.commit(t, {"train_loss": 1.0}, None, 100, now)


def test_buffered_version_is_the_staleness_weighted_delta_step() -> None:
    s = make(aggregation="buffered", buffer_size=2, server_lr=0.7)
    assert isinstance(s, BufferedStrategy)
    assert s.start(0.0) == {"a": True, "b": True, "c": True}  # concurrency: every client
    x1 = state(0)
    da, db, dc = state(1), state(2), state(3)
    upload(s, "a", 1, da)
    assert not s.ready()
    upload(s, "b", 1, db)
    assert s.ready()
    c1 = s.close(1.0)
    x2, _, row = s.aggregate(x1, c1)
    assert row["round"] == 1 and row["version"] == 2 and row["clients"] == 2 and row["staleness_max"] == 0
    for k in x1:
        want = x1[k].double() + 0.7 * (10 * da[k].double() + 30 * db[k].double()) / 40
        assert torch.allclose(x2[k].double(), want, atol=1e-6), k
    assert s.published(2.0) == {"a": True, "b": True}  # freed slots get version 2; c still trains on 1
    # c's update started from version 1: one version old, weight 1/sqrt(2)
    upload(s, "c", 1, dc)
    upload(s, "a", 2, da)
    c2 = s.close(3.0)
    x3, _, row = s.aggregate(x2, c2)
    w = 1 / math.sqrt(2)
    for k in x1:
        want = x2[k].double() + 0.7 * (w * 20 * dc[k].double() + 10 * da[k].double()) / 30
        assert torch.allclose(x3[k].double(), want, atol=1e-6), k
    assert row["staleness_mean"] == 0.5 and row["staleness_max"] == 1


def test_buffered_refusals_are_precise() -> None:
    s = make(aggregation="buffered", buffer_size=1, concurrency=2, max_staleness=0)
    assigned = s.start(0.0)
    assert len(assigned) == 2
    idle = next(c for c in IDS if c not in assigned)
    with pytest.raises(Refused, match="not asked to train on version 1") as e:
        s.open(idle, 1, SAMPLES[idle], "k", 0.0)
    assert e.value.code == Code.FAILED_PRECONDITION
    first, late = sorted(assigned)
    upload(s, first, 1, state(1), key="k1")
    with pytest.raises(AlreadyAccepted):  # a retry of a committed upload: its original outcome
        s.open(first, 1, SAMPLES[first], "k1", 0.0)
    s.aggregate(state(0), s.close(1.0))
    with pytest.raises(Refused, match="1 versions old; max_staleness=0") as e:
        s.open(late, 1, SAMPLES[late], "k", 2.0)
    assert e.value.code == Code.FAILED_PRECONDITION


def test_buffered_slot_expires_and_goes_to_another_client() -> None:
    s = make(aggregation="buffered", concurrency=1, round_deadline_s=10.0)
    (first,) = s.start(0.0)
    assert s.next_deadline() == 10.0
    assert s.tick(5.0) == {}
    handed = s.tick(10.0)
    assert len(handed) == 1 and first not in handed
    with pytest.raises(Refused, match="not asked"):
        s.open(first, 1, SAMPLES[first], "k", 11.0)


def test_staleness_functions() -> None:
    def f(kind: str, **kw):
        return staleness_function(load_config(None, {"staleness": kind, **kw}))

    assert f("sqrt")(3) == 0.5
    assert f("constant")(7) == 1.0
    assert f("poly", staleness_a=1.0)(3) == 0.25
    hinge = f("hinge", staleness_a=0.5, staleness_b=2)
    assert hinge(2) == 1.0 and hinge(4) == 0.5


def test_sync_deadline_extends_then_closes_short_then_aborts() -> None:
    s = make(round_deadline_s=10.0, max_round_retries=1, min_clients=2)
    assert isinstance(s, SyncStrategy)
    assert s.start(0.0) == {"a": True, "b": True, "c": True}
    upload(s, "a", 1, state(1))
    s.tick(10.0)  # one upload < min_clients: extended
    assert not s.ready() and s.next_deadline() == 20.0
    s.tick(20.0)  # retries used up and something arrived: closes short
    assert s.ready()
    s.aggregate(state(0), s.close(20.0))
    s.published(21.0)
    s.tick(31.0)
    with pytest.raises(RunAborted, match="round 2: no client uploaded within 2 deadlines"):
        s.tick(41.0)


def test_sync_refusals_keep_their_statuses() -> None:
    s = make(fraction=0.34)
    selected = [c for c, train in s.start(0.0).items() if train]
    assert len(selected) == 1
    other = next(c for c in IDS if c not in selected)
    cases = [
        ((other, 1), Code.FAILED_PRECONDITION, "not selected"),
        ((selected[0], 2), Code.FAILED_PRECONDITION, "has not opened"),
    ]
    for (cid, r), code, text in cases:
        with pytest.raises(Refused, match=text) as e:
            s.open(cid, r, SAMPLES[cid], "k", 0.0)
        assert e.value.code == code
    with pytest.raises(Refused, match="num_samples 999") as e:
        s.open(selected[0], 1, 999, "k", 0.0)
    upload(s, selected[0], 1, state(1), key="x")
    with pytest.raises(Refused, match="already uploaded") as e:
        s.open(selected[0], 1, SAMPLES[selected[0]], "other-key", 0.0)
    assert e.value.code == Code.ALREADY_EXISTS


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"algorithm": "feddyn"}, "feddyn.*does not combine with aggregation='buffered'"),
        ({"algorithm": "fedavgm"}, "fedavgm.*does not combine"),
        ({"fraction": 0.5}, "fraction, act_prob and min_clients apply to aggregation='sync'"),
        ({"buffer_size": 4, "concurrency": 3}, "buffer_size=4 is more than the 3 clients"),
        ({"concurrency": 0}, "concurrency=0 must be an integer >= 1"),
    ],
)
def test_buffered_config_refuses_what_makes_no_sense(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"num_clients": 3, "aggregation": "buffered", **overrides})


def test_buffered_default_sizes() -> None:
    cfg = load_config(None, {"num_clients": 8, "aggregation": "buffered"})
    assert (cfg.buffered_concurrency, cfg.buffered_size) == (8, 4)
    assert np.isclose(staleness_function(cfg)(0), 1.0)


def test_local_accuracy_is_the_test_set_weighted_mean_of_the_uploads_that_report_one() -> None:
    from wafl.server.strategy import local_accuracy

    uploads = [
        {"local_accuracy": 0.5, "local_test_samples": 30.0, "train_loss": 1.0},
        {"local_accuracy": 0.9, "local_test_samples": 10.0},
        {"local_accuracy": 0.2},  # no size: weight 1
        {"train_loss": 2.0},  # no accuracy: not counted
    ]
    assert local_accuracy(uploads, personal=False) == pytest.approx((0.5 * 30 + 0.9 * 10 + 0.2) / 41)
    assert local_accuracy(uploads, personal=True) is None  # the personal ones say pm_accuracy
    assert local_accuracy([{"pm_accuracy": 0.7, "pm_test_samples": 4.0}], personal=True) == pytest.approx(0.7)
    assert local_accuracy([], personal=False) is None

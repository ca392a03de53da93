"""Lock-step rounds (server/strategies/sync.py), transport-free: deadlines, refusals and the
results fields the policy owns."""

import pytest
from strategy_checks import IDS, SAMPLES, make, state, upload
from wafl.common.errors import Code, InvariantError, Refused, RunAborted
from wafl.server.strategies.base import local_accuracy
from wafl.server.strategies.sync import SyncStrategy


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


def test_local_accuracy_is_the_test_set_weighted_mean_of_the_uploads_that_report_one() -> None:
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


def test_a_rule_asked_about_its_collection_before_start_says_so() -> None:
    for aggregation in ("sync", "buffered"):
        s = make(aggregation=aggregation)
        with pytest.raises(InvariantError, match=f"aggregation={aggregation!r}: no collection is open"):
            s.ready()
        with pytest.raises(InvariantError, match="start was not called"):
            s.close(0.0)

"""FedAsync (server/strategies/fedasync.py): each update mixed into the model as it arrives,
against a direct re-computation of Xie et al.'s formula, its configuration section, and a short
in-process run whose clients learn from the broadcast header that they upload whole models."""

import math

import pytest
import torch
from strategy_checks import SAMPLES, make, state, upload
from wafl.cli.simulate import simulate
from wafl.common.codec import iter_chunks
from wafl.common.config import ConfigError, load_config
from wafl.server.checkpoint import load_checkpoint
from wafl.server.engine import RoundEngine
from wafl.server.strategies.fedasync import FedAsyncStrategy


def mixed(x: dict, new: dict, a: float) -> dict:
    """x <- (1 - a) x + a x_new, tensor by tensor, in float64."""
    return {k: (1 - a) * x[k].double() + a * new[k].double() for k in x}


def test_each_update_is_mixed_in_with_alpha_times_its_staleness_weight() -> None:
    s = make(aggregation="fedasync", aggregation_params={"alpha": 0.5}, staleness="poly", staleness_a=1.0)
    assert isinstance(s, FedAsyncStrategy) and not s.uploads_are_deltas
    assert s.start(0.0) == {"a": True, "b": True, "c": True}
    x1, xa, xb, xc = state(0), state(1), state(2), state(3)
    upload(s, "a", 1, xa)
    assert s.ready()  # one update makes a version
    x2, _, row = s.aggregate(x1, s.close(1.0))
    assert row["version"] == 2 and row["clients"] == 1 and row["staleness_max"] == 0
    want = mixed(x1, xa, 0.5)  # fresh: a = alpha
    for k in x1:
        assert torch.allclose(x2[k].double(), want[k], atol=1e-6), k
    s.published(2.0)
    # b trained on version 1, which is one version old now: a = 0.5 * (1 + 1)^-1
    upload(s, "b", 1, xb)
    x3, _, row = s.aggregate(x2, s.close(3.0))
    want = mixed(x2, xb, 0.25)
    for k in x1:
        assert torch.allclose(x3[k].double(), want[k], atol=1e-6), k
    assert row["staleness_mean"] == 1
    s.published(4.0)
    # c (version 1, now two versions old) and a (version 2, one old) finish into one version
    streaming = s.open("a", 2, SAMPLES["a"], "a-2", 4.5, {})  # a's upload is streaming when c's arrives
    upload(s, "c", 1, xc)
    closing = s.close(5.0)
    assert streaming.collection is closing  # it finishes into c's version (drain "wait")
    fold = closing.accumulator.begin(streaming.weight)
    specs = {sp.name: sp for sp in closing.accumulator.manifest}
    for c in iter_chunks(xa.items(), 16):
        fold.add(specs[c.name], c)
    fold.commit()
    s.commit(streaming, {}, None, 100, 5.5)
    x4, _, row = s.aggregate(x3, closing)
    ac, aa = 0.5 / 3, 0.5 / 2
    keep = (1 - ac) * (1 - aa)
    for k in x1:
        want = keep * x3[k].double() + (1 - keep) * (ac * xc[k].double() + aa * xa[k].double()) / (ac + aa)
        assert torch.allclose(x4[k].double(), want, atol=1e-6), k
    assert row["clients"] == 2


def test_the_mixing_weight_ignores_sample_counts_and_declared_steps() -> None:
    s = make(aggregation="fedasync", staleness="hinge", staleness_a=1.0, staleness_b=1)
    s.start(0.0)
    t, _ = upload(s, "b", 1, state(1), metrics={"train_steps": 7.0})
    assert t.weight == pytest.approx(0.6)  # the default alpha, fresh
    assert s.mixing(1) == pytest.approx(0.6) and s.mixing(3) == pytest.approx(0.6 / 3)  # hinge beyond b = 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"aggregation_params": {"alpha": 1.5}}, r"aggregation_params.alpha=1.5 must lie in \(0.0, 1.0\]"),
        ({"aggregation_params": {"alpha": 0}}, r"aggregation_params.alpha=0 must lie in"),
        ({"aggregation_params": {"beta": 1}}, "aggregation_params.beta is not a setting of aggregation='fedasync'"),
        ({"buffer_size": 2}, "buffer_size=2 applies to aggregation='buffered'"),
        ({"server_lr": 0.5}, "server_lr=0.5 applies to aggregation='buffered'"),
        ({"algorithm": "fedavgm"}, "fedavgm.*does not combine with aggregation='fedasync'"),
        ({"fraction": 0.5}, "fraction, act_prob and min_clients apply to aggregation='sync'"),
        ({"aggregator": "median"}, "median of 1 uploads"),
        ({"max_staleness": -1}, "max_staleness=-1 must be an integer >= 0"),
    ],
)
def test_config_refuses_what_makes_no_sense(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"num_clients": 3, "aggregation": "fedasync", **overrides})


def test_sync_and_buffered_have_no_aggregation_params() -> None:
    for rule in ("sync", "buffered"):
        with pytest.raises(ConfigError, match=f"aggregation_params.alpha is not a setting of aggregation='{rule}'"):
            load_config(None, {"aggregation": rule, "aggregation_params": {"alpha": 0.5}})


def test_clients_upload_whole_models_as_the_broadcast_header_says(tmp_path) -> None:
    """A short in-process run (real engine, real client protocol): the header says ``upload_delta``
    false, so clients upload their trained models and the mixed model keeps its size. Clients that
    uploaded differences would shrink it to about 0.4 of itself at every version (0.4^4 in all)."""
    cfg = load_config(
        None,
        {
            "num_clients": 3,
            "rounds": 4,
            "seed": 1,
            "aggregation": "fedasync",
            "protocol": "compute-and-wait",
            "local_epochs": 1,
        },
    )
    initial = RoundEngine(cfg, tmp_path / "initial").global_state
    rows = simulate(cfg, tmp_path / "run")
    assert [r["version"] for r in rows] == list(range(2, 6))
    final = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["global_state"]

    def norm(st: dict) -> float:
        return math.sqrt(sum(float(v.double().pow(2).sum()) for v in st.values() if v.is_floating_point()))

    assert norm(final) > 0.5 * norm(initial)

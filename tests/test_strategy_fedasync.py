"""FedAsync (server/strategies/fedasync.py): each update mixed into the model as it arrives,
against a direct re-computation of Xie et al.'s formula, its configuration section, and a short
in-process run whose clients learn from the broadcast header that they upload whole models."""

import math

import pytest
import torch
from strategy_checks import SAMPLES, make, state, upload
from wafl.cli.sim.simulate import simulate
from wafl.common.codec import iter_chunks
from wafl.common.config import ConfigError, load_config
from wafl.server.checkpoint import load_checkpoint
from wafl.server.engine import RoundEngine
from wafl.server.strategies import check_aggregation
from wafl.server.strategies.fedasync import FedAsyncStrategy


def mixed(x: dict, new: dict, a: float) -> dict:
    """x <- (1 - a) x + a x_new, tensor by tensor, in float64."""
    return {k: (1 - a) * x[k].double() + a * new[k].double() for k in x}


def xie_poly(alpha: float, a: float, t: int, tau: int, fresh: int) -> float:
    """Xie et al.'s ``alpha_t = alpha * s_a(t - tau)``, ``s_a(t - tau) = (t - tau + 1)^-a``, for the
    updater's epoch ``t`` that builds ``x_t`` from ``x_{t-1}`` with an update trained on ``x_tau``
    (``fresh = 1``); ``fresh = 0``: FLSim's staleness, the versions published since ``tau``
    (``t - 1 - tau``)."""
    return alpha * (t - tau + 1 - (1 - fresh)) ** -a


@pytest.mark.parametrize("fresh", [1, 0])
def test_each_update_is_mixed_in_with_alpha_times_its_staleness_weight(fresh) -> None:
    params = {"alpha": 0.5, "fresh_staleness": fresh}
    s = make(aggregation="fedasync", aggregation_params=params, staleness="poly", staleness_a=1.0)
    assert isinstance(s, FedAsyncStrategy) and not s.uploads_are_deltas
    assert s.start(0.0) == {"a": True, "b": True, "c": True}
    x1, xa, xb, xc = state(0), state(1), state(2), state(3)
    upload(s, "a", 1, xa)
    assert s.ready()  # one update makes a version
    x2, _, row = s.aggregate(x1, s.close(1.0))
    assert row["version"] == 2 and row["clients"] == 1 and row["staleness_max"] == 0
    want = mixed(x1, xa, xie_poly(0.5, 1.0, 2, 1, fresh))  # fresh: alpha / 2 (Xie), alpha (FLSim)
    for k in x1:
        assert torch.allclose(x2[k].double(), want[k], atol=1e-6), k
    s.published(2.0)
    # b trained on version 1, which is one version old now
    upload(s, "b", 1, xb)
    x3, _, row = s.aggregate(x2, s.close(3.0))
    want = mixed(x2, xb, xie_poly(0.5, 1.0, 3, 1, fresh))
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
    ac, aa = xie_poly(0.5, 1.0, 4, 1, fresh), xie_poly(0.5, 1.0, 4, 2, fresh)
    keep = (1 - ac) * (1 - aa)
    for k in x1:
        want = keep * x3[k].double() + (1 - keep) * (ac * xc[k].double() + aa * xa[k].double()) / (ac + aa)
        assert torch.allclose(x4[k].double(), want, atol=1e-6), k
    assert row["clients"] == 2


@pytest.mark.parametrize("fresh", [1, 0])
def test_an_upload_between_a_close_and_the_next_version_is_mixed_as_one_version_old(fresh) -> None:
    """b's model from version 1 arrives after a's closed the collection that makes version 2 and
    before version 2 is built: it is mixed into version 2 to make version 3 (Xie's epoch t = 3,
    tau = 1), so it is one version old, not fresh."""
    params = {"alpha": 0.5, "fresh_staleness": fresh}
    s = make(aggregation="fedasync", aggregation_params=params, staleness="poly", staleness_a=1.0)
    s.start(0.0)
    x1, xa, xb = state(0), state(1), state(2)
    upload(s, "a", 1, xa)
    c1 = s.close(1.0)
    tb, _ = upload(s, "b", 1, xb, now=1.5)  # the engine aggregates c1 now
    assert tb.staleness == 1 and tb.collection is s.current
    x2, _, _ = s.aggregate(x1, c1)
    s.published(2.0)
    x3, _, row = s.aggregate(x2, s.close(3.0))
    assert row["staleness_max"] == 1
    want = mixed(mixed(x1, xa, xie_poly(0.5, 1.0, 2, 1, fresh)), xb, xie_poly(0.5, 1.0, 3, 1, fresh))
    for k in x1:
        assert torch.allclose(x3[k].double(), want[k], atol=1e-6), k


def test_the_mixing_weight_ignores_sample_counts_and_declared_steps() -> None:
    s = make(aggregation="fedasync", staleness="hinge", staleness_a=1.0, staleness_b=1)
    assert s.config.fresh_staleness == 1  # Xie et al.'s index by default
    s.start(0.0)
    t, _ = upload(s, "b", 1, state(1), metrics={"train_steps": 7.0})
    assert t.weight == pytest.approx(0.6)  # the default alpha, fresh: hinge(1) = 1 with b = 1
    # one version old: t - tau = 2, beyond b = 1: 1/(a(2 - 1) + 1); three old: 1/(a(4 - 1) + 1)
    assert s.mixing(1) == pytest.approx(0.6 / 2) and s.mixing(3) == pytest.approx(0.6 / 4)
    s = make(
        aggregation="fedasync",
        staleness="hinge",
        staleness_a=1.0,
        staleness_b=1,
        aggregation_params={"fresh_staleness": 0},
    )
    assert s.mixing(0) == pytest.approx(0.6) and s.mixing(1) == pytest.approx(0.6)
    assert s.mixing(3) == pytest.approx(0.6 / 3)  # FLSim's index: 1/(a(3 - 1) + 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"aggregation_params": {"alpha": 1.5}}, r"aggregation_params.alpha=1.5 must lie in \(0.0, 1.0\]"),
        ({"aggregation_params": {"alpha": 0}}, r"aggregation_params.alpha=0 must lie in"),
        ({"aggregation_params": {"beta": 1}}, "aggregation_params.beta is not a setting of aggregation='fedasync'"),
        ({"aggregation_params": {"fresh_staleness": 2}}, r"aggregation_params.fresh_staleness=2 must be 0 \(FLSim"),
        ({"aggregation_params": {"weighting": "samples"}}, "aggregation_params.weighting is not a setting of aggr"),
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
        check_aggregation(load_config(None, {"num_clients": 3, "aggregation": "fedasync", **overrides}))


def test_sync_and_buffered_have_no_alpha() -> None:
    for rule in ("sync", "buffered"):
        with pytest.raises(ConfigError, match=f"aggregation_params.alpha is not a setting of aggregation='{rule}'"):
            check_aggregation(load_config(None, {"aggregation": rule, "aggregation_params": {"alpha": 0.5}}))


def test_clients_upload_whole_models_as_the_broadcast_header_says(tmp_path) -> None:
    """A short in-process run (real engine, real client protocol): the header says ``upload_delta``
    false, so clients upload their trained models and the mixed model keeps its size. Clients that
    uploaded differences would shrink it to about 1 - a of itself at every version (a = 0.6 / sqrt(2)
    for a fresh update under the defaults: 0.58^4 in all)."""
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

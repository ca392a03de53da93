"""Heterogeneous clients: reproducible slow-downs, link rates and dropouts, and what they do to a run."""

import json
import math

import numpy as np
import pytest
from wafl.cli.launch.launcher import launch
from wafl.cli.sim.simulate import simulate
from wafl.common.config import ConfigError, load_config
from wafl.common.heterogeneity import drops_out, link_rates, slowdowns


def test_slowdowns_from_a_list_a_distribution_or_none() -> None:
    assert slowdowns("none", 3, 0) == [1.0, 1.0, 1.0]
    assert slowdowns("1,2.5,4", 3, 0) == [1.0, 2.5, 4.0]
    lognormal = slowdowns("lognormal:sigma=1", 200, 5)
    assert lognormal == slowdowns("lognormal:sigma=1", 200, 5)  # reproducible from the seed
    assert lognormal != slowdowns("lognormal:sigma=1", 200, 6)
    z = np.random.default_rng([5, 21]).standard_normal(200)
    assert lognormal == [max(1.0, math.exp(v)) for v in z]
    assert 0.35 < np.mean(np.array(lognormal) == 1.0) < 0.65  # about half run at full speed


@pytest.mark.parametrize(
    "spec, message",
    [
        ("1,2", "exactly one value per client \\(3\\), got 2"),
        ("1,0.5,2", "'0.5' is not a factor >= 1"),
        ("lognormal:mu=1", "expected lognormal:sigma=..."),
        ("lognormal:sigma=-1", "sigma must be a number >= 0"),
    ],
)
def test_bad_slowdowns_name_the_field(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match="slowdown=.*" + message):
        load_config(None, {"num_clients": 3, "slowdown": spec})


def test_link_rates() -> None:
    assert link_rates("20mbit", 3, 0) == ["20mbit"] * 3
    assert link_rates("10mbit, 20mbit,1gbit", 3, 0) == ["10mbit", "20mbit", "1gbit"]
    rates = link_rates("lognormal:median=20mbit,sigma=0.5", 50, 1)
    bits = sorted(int(r[:-3]) for r in rates)
    assert 12e6 < bits[25] < 30e6 and bits[0] < bits[-1]
    with pytest.raises(ValueError, match="one value per client"):
        link_rates("10mbit,20mbit", 3, 0)
    with pytest.raises(ValueError, match="invalid link-rate"):
        link_rates("fast", 3, 0)


def test_dropouts_are_a_function_of_seed_client_and_version() -> None:
    draws = [drops_out(3, i, v, 0.3) for i in range(20) for v in range(1, 51)]
    assert draws == [drops_out(3, i, v, 0.3) for i in range(20) for v in range(1, 51)]
    assert 0.25 < np.mean(draws) < 0.35
    assert not any(drops_out(3, i, 1, 0.0) for i in range(100))


def test_in_process_buffered_run_learns_with_slow_clients(tmp_path) -> None:
    cfg = load_config(
        None,
        {"num_clients": 4, "rounds": 8, "aggregation": "buffered", "buffer_size": 2, "slowdown": "1,1,1,3", "seed": 1},
    )
    rows = simulate(cfg, tmp_path)
    assert [r["round"] for r in rows] == list(range(1, 9))
    assert all(r["clients"] >= 2 and r["version"] == r["round"] + 1 for r in rows)
    assert max(r["staleness_max"] for r in rows) >= 1  # the slow client's updates arrive late
    assert rows[-1]["gm_accuracy"] > 0.4  # chance is 0.1
    timelines = json.loads((tmp_path / "timelines.json").read_text())
    slowed = {c for c, t in timelines.items() if any(e["phase"] == "slowdown" for e in t["events"])}
    assert slowed == {"client-3"}
    for e in timelines["client-3"]["events"]:
        if e["phase"] == "slowdown":
            gm = next(
                g
                for g in timelines["client-3"]["events"]
                if g["phase"] == "gm_train" and g["end_s"] <= e["start_s"] + 1e-9 and g["round"] == e["round"]
            )
            assert (e["end_s"] - e["start_s"]) == pytest.approx(2 * (gm["end_s"] - gm["start_s"]), rel=0.2, abs=0.02)


def test_buffered_over_grpc_with_dropouts(tmp_path) -> None:
    cfg = load_config(
        None,
        {
            "num_clients": 4,
            "rounds": 6,
            "aggregation": "buffered",
            "buffer_size": 2,
            "dropout": 0.3,
            "round_deadline_s": 3.0,
            "algorithm": "ditto",
            "protocol": "compute-and-wait",
        },
    )
    s = launch(cfg, tmp_path / "run", show_progress=False, timeout_s=300)
    assert s.ok, (tmp_path / "run" / "logs" / "server.log").read_text()[-2000:]
    assert [r["round"] for r in s.rows] == list(range(1, 7))
    timelines = json.loads((tmp_path / "run" / "timelines.json").read_text())
    phases = [e["phase"] for t in timelines.values() for e in t["events"]]
    assert "offline" in phases and "pm_train" in phases
    assert s.rows[-1]["pm_accuracy"] is not None


def test_buffered_fedhkd_aggregates_knowledge_per_version(tmp_path) -> None:
    cfg = load_config(
        None,
        {
            "num_clients": 3,
            "rounds": 4,
            "aggregation": "buffered",
            "buffer_size": 2,
            "algorithm": "fedhkd",
            # every class a client holds is shared: which two clients' updates build version 1 depends on
            # their timing, and at the default nu = 0.25 a client without a class of a quarter of its data
            # shares none
            "params": {"nu": 0.0},
            "optimizer": "adam",
            "lr": 0.003,
        },
    )
    rows = simulate(cfg, tmp_path)
    assert len(rows) == 4
    # a version carries the knowledge of the updates it was built from (classes >= nu of a client's data)
    assert rows[0]["knowledge_classes"] > 0
    # updates trained on a version that carried knowledge report having received it
    assert rows[0]["knowledge_received_min"] == 0 and max(r["knowledge_received_min"] for r in rows) > 0
    assert rows[-1]["epsilon"] > rows[0]["epsilon"]

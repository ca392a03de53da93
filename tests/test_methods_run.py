"""Every method of the comparisons runs a short federation in process (the engine, strategy, client
protocol and trainer of ``wafl run``), under both protocols where it has a personal model, and
reports the accuracies it defines."""

import pytest
from wafl.cli.simulate import simulate
from wafl.common.algorithms import registry
from wafl.common.config import load_config

PERSONAL = ["fedrep", "fedbabu", "fedrod", "pfedme"]
GLOBAL = ["moon", "fedsam", "scaffold", "fedspeed", "fedmd", "fedproto", "fedgen", "fedalign"]
CASES = [(a, p) for a in PERSONAL for p in ("wait-free", "compute-and-wait")] + [(a, "wait-free") for a in GLOBAL]


@pytest.mark.parametrize(("algorithm", "protocol"), CASES)
def test_method_runs_a_short_federation(algorithm: str, protocol: str) -> None:
    cfg = load_config(
        None,
        {
            "algorithm": algorithm,
            "num_clients": 3,
            "rounds": 2,
            "local_epochs": 1,
            "pm_max_epochs": 1,
            "protocol": protocol,
            "checkpoint": False,
        },
    )
    rows = simulate(cfg)
    algo = registry.resolve(algorithm, {}, vars(cfg))
    assert [r["round"] for r in rows] == [1, 2]
    assert all((r["gm_accuracy"] is not None) == algo.evaluates_global for r in rows)
    assert all((r["pm_accuracy"] is not None) == (algo.personal != "none") for r in rows)
    # the FedHKD paper's local accuracy: every method whose local model is not trained further
    local = algo.personal == "none" or algo.local_model_is_personal
    assert all((r.get("local_accuracy") is not None) == local for r in rows)
    if algo.local_model_is_personal:  # the local model is the PM: the same accuracies
        assert all(r["local_accuracy"] == r["pm_accuracy"] for r in rows)
    assert all(r["clients"] == 3 for r in rows)


def test_fedavg_reports_the_local_accuracy_of_its_trained_models() -> None:
    cfg = load_config(None, {"algorithm": "fedavg", "num_clients": 3, "rounds": 2, "checkpoint": False})
    rows = simulate(cfg)
    assert rows[0]["pm_accuracy"] is None
    assert all(r["local_accuracy"] is not None and r["local_accuracy"] > 0.3 for r in rows)  # chance: 0.1

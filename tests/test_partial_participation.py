"""Under partial participation, an unselected client trains its personal part when its algorithm
says so (``pm_when_unselected``), under both protocols, and its report counts in the round."""

import pytest
from wafl.cli.simulate import simulate
from wafl.common.algorithms import registry
from wafl.common.config import load_config


def run(algorithm: str, protocol: str) -> list[dict]:
    cfg = load_config(
        None,
        {
            "algorithm": algorithm,
            "num_clients": 4,
            "fraction": 0.5,
            "rounds": 2,
            "local_epochs": 1,
            "pm_epochs": 1,
            "pm_max_epochs": 1,
            "protocol": protocol,
            "checkpoint": False,
        },
    )
    return simulate(cfg)


@pytest.mark.parametrize("protocol", ["wait-free", "compute-and-wait"])
def test_unselected_clients_train_their_personal_part_when_the_method_says_so(protocol: str) -> None:
    assert registry.resolve("fedrep").pm_when_unselected
    assert not registry.resolve("ditto").pm_when_unselected
    rows = run("fedrep", protocol)
    assert [r["selected"] for r in rows] == [2, 2]
    assert [r["pm_reports"] for r in rows] == [4, 4]  # every client trained its head and reported
    rows = run("ditto", protocol)
    assert [r["pm_reports"] for r in rows] == [2, 2]  # only the selected ones

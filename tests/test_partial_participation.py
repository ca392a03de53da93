"""Under partial participation, an unselected client trains its personal part when its algorithm
says so (``pm_when_unselected``), under both protocols, and its report counts in the round."""

import json
from pathlib import Path

import pytest
from wafl.cli.sim.simulate import simulate
from wafl.common.algorithms import registry
from wafl.common.config import load_config


def run(algorithm: str, protocol: str, out: Path) -> tuple[list[dict], list[tuple[str, int]]]:
    """The run's rows, and every (client, round) in which a client trained its PM without being selected
    (a ``pm_train`` phase in a round without its ``gm_train``), from its timeline."""
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
    rows = simulate(cfg, out)
    unselected_pm = []
    for client, t in sorted(json.loads((out / "timelines.json").read_text()).items()):
        gm = {e["round"] for e in t["events"] if e["phase"] == "gm_train"}
        unselected_pm += sorted(
            {(client, e["round"]) for e in t["events"] if e["phase"] == "pm_train"} - {(client, r) for r in gm}
        )
    return rows, unselected_pm


@pytest.mark.parametrize("protocol", ["wait-free", "compute-and-wait"])
def test_unselected_clients_train_their_personal_part_when_the_method_says_so(protocol: str, tmp_path: Path) -> None:
    assert registry.resolve("fedrep").pm_when_unselected
    assert not registry.resolve("ditto").pm_when_unselected
    rows, unselected_pm = run("fedrep", protocol, tmp_path / "fedrep")
    assert [r["selected"] for r in rows] == [2, 2]
    assert unselected_pm  # seed 0: clients 0 and 2 are left out of round 1, client 2 out of round 2 as well
    reports = [r["pm_reports"] for r in rows]
    if protocol == "compute-and-wait":
        assert reports == [4, 4]  # every client trained its head and reported
        assert len(unselected_pm) == 4
    else:
        # wait-free: an unselected client trains its head until the next broadcast, then reports; on a busy
        # machine the round after may close first (the report then misses the line), or a client that lags
        # skips to the newest model, so the lines count the selected clients' reports at least
        assert min(reports) >= 2, reports
    rows, unselected_pm = run("ditto", protocol, tmp_path / "ditto")
    assert not unselected_pm  # only the selected clients train their PM
    reports = [r["pm_reports"] for r in rows]
    if protocol == "compute-and-wait":
        assert reports == [2, 2]
    else:  # a client selected in round 1 only may report round 1 after round 2 closed
        assert reports[0] in (1, 2) and reports[1] == 2, reports

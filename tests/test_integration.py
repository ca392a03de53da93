"""Real server and client processes over localhost sockets."""

import json

from wafl.cli.launch.launcher import launch
from wafl.common.codec import crc32_of
from wafl.common.config import load_config
from wafl.server.checkpoint import load_checkpoint


def reports(out):
    return [json.loads(line) for line in (out / "reports.jsonl").read_text().splitlines()]


def test_fedavg_three_clients_three_rounds(tmp_path) -> None:
    cfg = load_config(None, {"num_clients": 3, "rounds": 3})
    s = launch(cfg, tmp_path / "run", show_progress=False, timeout_s=300)
    assert s.ok, (tmp_path / "run" / "logs" / "server.log").read_text()[-2000:]
    assert [r["round"] for r in s.rows] == [1, 2, 3]
    assert s.rows[-1]["gm_accuracy"] > 0.3  # chance is 0.1
    assert all(r["clients"] == 3 and r["bytes_up"] > 0 for r in s.rows)
    # every client ends holding the identical global model: the server's own
    ck = load_checkpoint(tmp_path / "run" / "checkpoint.pt")
    server_crc = crc32_of(ck["global_state"].values())
    finals = [r for r in reports(tmp_path / "run") if r.get("final") == 1.0]
    assert len(finals) == 3
    assert {int(r["global_crc32"]) for r in finals} == {server_crc}
    assert (tmp_path / "run" / "accuracy.png").stat().st_size > 1000
    assert json.loads((tmp_path / "run" / "config.json").read_text())["num_clients"] == 3


def test_scd_wait_free_reports_pm_accuracy_and_timelines(tmp_path) -> None:
    cfg = load_config(None, {"num_clients": 2, "rounds": 2, "algorithm": "scd", "protocol": "wait-free"})
    s = launch(cfg, tmp_path / "run", show_progress=False, timeout_s=300)
    assert s.ok
    assert all(r["pm_accuracy"] is not None and 0 <= r["pm_accuracy"] <= 1 for r in s.rows)
    timelines = json.loads((tmp_path / "run" / "timelines.json").read_text())
    assert set(timelines) == {"client-0", "client-1"}
    for t in timelines.values():
        phases = {e["phase"] for e in t["events"]}
        assert {"gm_train", "upload", "pm_train", "evaluate"} <= phases
        for r in (1, 2):
            up = next(e for e in t["events"] if e["phase"] == "upload" and e["round"] == r)
            pm = next(e for e in t["events"] if e["phase"] == "pm_train" and e["round"] == r)
            assert pm["start_s"] <= up["end_s"]  # the PM trains while the upload is in flight


def test_fedhkd_knowledge_flows_both_ways(tmp_path) -> None:
    cfg = load_config(None, {"num_clients": 3, "rounds": 3, "algorithm": "fedhkd", "optimizer": "adam", "lr": 0.003})
    s = launch(cfg, tmp_path / "run", show_progress=False, timeout_s=300)
    assert s.ok
    # up: the server aggregated knowledge every round; down: clients trained with it from round 2 on
    assert all(r["knowledge_classes"] > 0 for r in s.rows)
    assert [r["knowledge_received_min"] > 0 for r in s.rows] == [False, True, True]
    assert all(r["pm_accuracy"] is not None for r in s.rows)
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert 0 < privacy["per_release"]["epsilon_per_release"] < privacy["per_run"]["epsilon_per_run"]
    assert s.rows[-1]["epsilon"] == privacy["per_run"]["epsilon_per_run"]

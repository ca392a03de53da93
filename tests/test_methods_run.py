"""Every method of the comparisons runs a short federation in process (the engine, strategy, client
protocol and trainer of ``wafl run``), under both protocols where it has a personal model, and
reports the accuracies it defines."""

from pathlib import Path
from typing import Any

import pytest
from wafl.cli.sim.simulate import simulate
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
    algo = registry.resolve(algorithm, {}, cfg.to_dict())
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


@pytest.mark.parametrize("algorithm", ["fedavg", "fedhkd", "scd"])
def test_eval_every_evaluates_the_clients_models_in_the_same_rounds_as_the_global_one(
    algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``eval_every`` 2 over 3 rounds: the global model, the uploads' local accuracies and the PMs'
    reports in rounds 2 and 3 only; the clients do not evaluate in round 1 (no call), and the first
    line does not wait for PM reports that never come."""
    from wafl.client.trainer import Trainer

    evaluated: list[int] = []
    orig = Trainer.evaluate_local

    def counting(self: Trainer, model: object) -> tuple[float, int]:
        assert self.ctx is not None
        evaluated.append(self.ctx.round)
        return orig(self, model)  # type: ignore[arg-type]

    monkeypatch.setattr(Trainer, "evaluate_local", counting)
    settings = {"num_clients": 3, "rounds": 3, "local_epochs": 1, "protocol": "compute-and-wait"}
    cfg = load_config(None, {**settings, "algorithm": algorithm, "eval_every": 2, "checkpoint": False})
    rows = simulate(cfg)
    algo = registry.resolve(algorithm, {}, cfg.to_dict())
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r["gm_accuracy"] is not None for r in rows] == [False, True, True]
    if algo.personal == "none" or algo.local_model_is_personal:
        assert [r.get("local_accuracy") is not None for r in rows] == [False, True, True]
    if algo.personal != "none":
        assert [r["pm_accuracy"] is not None for r in rows] == [False, True, True]
        assert rows[0]["pm_reports"] == 0 and rows[1]["pm_reports"] == 3
    assert sorted(set(evaluated)) == [2, 3] and len(evaluated) == 6  # 3 clients in each evaluated round


def test_a_simulation_in_a_temporary_folder_writes_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``out_dir`` the run's folder is deleted at the end: it writes no checkpoint (nothing could
    resume from it), and builds the same models; with ``out_dir`` it checkpoints every round as configured."""
    import wafl.server.setup as setup_module

    saved: list[Path] = []
    orig = setup_module.save_checkpoint

    def counting(path: Path, payload: dict[str, Any]) -> None:
        saved.append(path)
        orig(path, payload)

    monkeypatch.setattr(setup_module, "save_checkpoint", counting)
    cfg = load_config(None, {"algorithm": "fedavg", "num_clients": 3, "rounds": 2, "keep_checkpoint_every": 1})
    temporary = simulate(cfg)
    assert saved == []
    kept = simulate(cfg, tmp_path)
    assert (tmp_path / "checkpoint.pt").is_file() and (tmp_path / "checkpoints" / "round-2.pt").is_file()
    assert len(saved) == 4  # checkpoint.pt and checkpoints/round-N.pt, each round
    assert [r["gm_accuracy"] for r in temporary] == [r["gm_accuracy"] for r in kept]

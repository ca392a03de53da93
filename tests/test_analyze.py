"""``wafl analyze flatness`` on run folders: the model and data it rebuilds, its JSON, its table, its errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from wafl.cli.main import main
from wafl.cli.report.analyze import load_run_model, sample_indices, training_union
from wafl.cli.sim.simulate import simulate
from wafl.client.trainer import Trainer
from wafl.common.algorithms.base import split_payload
from wafl.common.config import ConfigError, load_config
from wafl.server.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep-like folder of two finished 2-round digits runs (seeds 0 and 1) with checkpoints."""
    root = tmp_path_factory.mktemp("runs")
    for seed in (0, 1):
        cfg = load_config(
            None,
            {"num_clients": 3, "rounds": 2, "local_epochs": 1, "device": "cpu", "seed": seed, "code_len": 8}
            | ({"keep_checkpoint_every": 1} if seed == 0 else {}),
        )
        simulate(cfg, root / f"seed={seed}")
    return root


FAST = ["--samples", "24", "--probes", "3", "--max-iter", "3", "--batch-size", "16"]


def test_the_run_model_is_the_final_global_model_on_the_clients_data(runs: Path) -> None:
    run = load_run_model(runs / "seed=0")
    assert run.round == 2
    ck = load_checkpoint(runs / "seed=0" / "checkpoint.pt")
    assert ck is not None
    state = split_payload(ck["global_state"])[0]
    assert all(torch.equal(run.model.state_dict()[k], v) for k, v in state.items())
    union = np.sort(np.concatenate([Trainer(run.config, i, dataset=run.dataset).train_idx for i in range(3)]))
    assert np.array_equal(training_union(run.config, run.dataset), union)
    assert np.array_equal(run.train_idx, union)
    first = load_run_model(runs / "seed=0", runs / "seed=0" / "checkpoints" / "round-1.pt")
    assert first.round == 1
    assert not torch.equal(first.model.classifier.weight, run.model.classifier.weight)
    assert (runs / "seed=0" / "checkpoints" / "round-2.pt").read_bytes() == (
        runs / "seed=0" / "checkpoint.pt"
    ).read_bytes()
    assert not (runs / "seed=1" / "checkpoints").exists()
    a, b = sample_indices(union, 50, 7), sample_indices(union, 50, 7)
    assert np.array_equal(a, b) and len(set(a)) == 50 and set(a) <= set(union)
    assert not np.array_equal(a, sample_indices(union, 50, 8))
    assert np.array_equal(sample_indices(union, None, 0), union)


def test_wafl_analyze_flatness_writes_its_json_and_density(runs: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "flat.json", tmp_path / "density.png"
    args = ["analyze", "flatness", str(runs / "seed=0"), *FAST, "--density", str(png), "--lanczos-steps", "5"]
    assert main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["round"] == 2 and doc["algorithm"] == "fedavg" and doc["samples"] == 24
    assert doc["training_samples"] == len(load_run_model(runs / "seed=0").train_idx)
    assert doc["parameters"] == sum(p.numel() for p in load_run_model(runs / "seed=0").model.parameters())
    assert doc["top_eigenvalue"]["iterations"] <= 3 and np.isfinite(doc["top_eigenvalue"]["value"])
    assert doc["trace"]["probes"] == 3 and doc["trace"]["stderr"] >= 0
    assert doc["density"]["steps"] == 5 and png.read_bytes()[:4] == b"\x89PNG"
    assert doc["hvp_products"] == doc["top_eigenvalue"]["iterations"] + 3 + 5
    # the same sample, probes and model: the same numbers
    assert main([*args[:3], *FAST, "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["trace"] == doc["trace"] and again["top_eigenvalue"] == doc["top_eigenvalue"]
    threads = torch.get_num_threads()
    try:  # one thread: the same estimates but for float rounding (reductions split otherwise)
        assert main([*args[:3], *FAST, "--threads", "1", "--json", str(tmp_path / "one.json")]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["trace"]["mean"] == pytest.approx(doc["trace"]["mean"], rel=1e-4)
    assert one["top_eigenvalue"]["value"] == pytest.approx(doc["top_eigenvalue"]["value"], rel=1e-4)
    assert main([*args[:3], *FAST, "--round", "1", "--json", str(tmp_path / "r1.json")]) == 0
    early = json.loads((tmp_path / "r1.json").read_text())
    assert early["round"] == 1 and early["checkpoint"].endswith("round-1.pt")
    assert early["loss"] > doc["loss"]  # the model of round 1 fits the clients' data less well


def test_several_runs_make_a_table_over_seeds(runs: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "table.json"
    assert main(["analyze", "flatness", str(runs), *FAST, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 2
    row = doc["rows"]["fedavg"]
    assert sorted(row["seeds"]) == [0, 1]
    tops = [r["top_eigenvalue"]["value"] for r in doc["runs"]]
    assert row["top_eigenvalue"]["mean"] == pytest.approx(sum(tops) / 2)
    assert "| fedavg | 2 |" in capsys.readouterr().out


def test_mistakes_are_one_line(runs: Path, tmp_path: Path, capsys) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(runs / "seed=0" / "config.json", bare / "config.json")
    assert main(["analyze", "flatness", str(bare)]) == 2
    assert "no run folder with a checkpoint.pt" in capsys.readouterr().err
    assert main(["analyze", "flatness", str(runs), "--density", str(tmp_path / "d.png")]) == 2
    assert "--density draws one run's density" in capsys.readouterr().err
    assert main(["analyze", "flatness", str(runs / "seed=0"), "--checkpoint", str(bare / "config.json")]) == 2
    assert "not a wafl checkpoint" in capsys.readouterr().err
    assert main(["analyze", "flatness", str(runs / "seed=1"), "--round", "1"]) == 2
    assert "rounds are kept with keep_checkpoint_every" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="keep_checkpoint_every=2 needs checkpoint = true"):
        load_config(None, {"keep_checkpoint_every": 2, "checkpoint": False})
    with pytest.raises(ConfigError, match="keep_checkpoint_every"):
        load_config(None, {"keep_checkpoint_every": -1})
    with pytest.raises(SystemExit):
        main(["analyze", "flatness", str(runs / "seed=0"), "--probes", "0"])

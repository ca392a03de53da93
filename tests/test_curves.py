"""``wafl analyze curves``: grouping, filtering and the numbers it draws, on hand-written run folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wafl.cli.main import main
from wafl.common.config import RunConfig


def write_run(folder: Path, seed: int, tau: float, lambda_p: float, rows: list[dict]) -> None:
    folder.mkdir(parents=True)
    cfg = json.loads(RunConfig.from_mapping(dict(algorithm="scd", rounds=len(rows), seed=seed)).to_json())
    cfg["params"] = {"tau": tau, "lambda_p": lambda_p, "lambda_g": 0.3, "spectrum": "model"}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "results.jsonl").write_text("".join(json.dumps({"round": i + 1, **r}) + "\n" for i, r in enumerate(rows)))


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    for seed in (0, 1):
        for tau in (0.2, 0.4):
            rows = [
                {"gm_accuracy": 0.1 * r + tau + seed / 10, "pm_accuracy": 0.5 + tau, "grad_dissimilarity": None}
                for r in range(3)
            ]
            rows[1]["grad_dissimilarity"] = 2.0 + tau + seed
            write_run(root / f"tau={tau},seed={seed}", seed, tau, 0.4, rows)
    write_run(root / "other", 0, 0.4, 4.0, [{"gm_accuracy": 0.9, "pm_accuracy": 0.9}] * 3)
    return root


def test_curves_are_means_over_seeds_of_the_selected_runs(sweep: Path, tmp_path: Path) -> None:
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    args = ["analyze", "curves", str(sweep), "--where", "params.lambda_p=0.4", "--by", "params.tau"]
    assert main([*args, "--out", str(png), "--json", str(out)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(out.read_text())
    assert sorted(doc["groups"]) == ["tau=0.2", "tau=0.4"]  # the lambda_p = 4 run is left out
    g = doc["groups"]["tau=0.4"]
    assert g["seeds"] == [0, 1]
    assert g["gm_accuracy"]["round"] == [1, 2, 3]
    assert g["gm_accuracy"]["mean"] == pytest.approx([0.45, 0.55, 0.65])
    assert g["gm_accuracy"]["min"] == pytest.approx([0.4, 0.5, 0.6])
    assert g["pm_accuracy"]["max"] == pytest.approx([0.9, 0.9, 0.9])


def test_against_a_setting_and_rounds_without_values(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    args = ["analyze", "curves", str(sweep), "--where", "params.lambda_p=0.4", "--metrics", "grad_dissimilarity"]
    assert main([*args, "--by", "params.tau", "--against", "params.tau", "--out", str(tmp_path / "a.png")]) == 0
    assert main([*args, "--against", "params.tau", "--out", str(tmp_path / "b.png"), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    g = doc["groups"]["scd lambda_g=0.3, lambda_p=0.4, spectrum=model, tau=0.2"]
    assert g["grad_dissimilarity"]["round"] == [2]  # the rounds where it was measured
    assert [pytest.approx(p) for p in doc["points"]] == [[0.2, 2.7, 2.2, 3.2], [0.4, 2.9, 2.4, 3.4]]
    last = ["analyze", "curves", str(sweep), "--by", "params.lambda_p", "--metrics", "gm_accuracy"]
    assert main([*last, "--against", "params.lambda_p", "--reduce", "last", "--out", str(tmp_path / "l.png")]) == 0


def test_mistakes_are_one_line(sweep: Path, tmp_path: Path, capsys) -> None:
    png = str(tmp_path / "x.png")
    assert main(["analyze", "curves", str(sweep), "--where", "params.tau=0.9", "--out", png]) == 2
    assert "no run matches --where params.tau=0.9" in capsys.readouterr().err
    assert main(["analyze", "curves", str(sweep), "--metrics", "nothing", "--out", png]) == 2
    assert "no run has values of nothing" in capsys.readouterr().err
    assert main(["analyze", "curves", str(tmp_path / "none"), "--out", png]) == 2


def test_panels_split_the_curves_by_a_field_and_name_them_without_it(sweep: Path, tmp_path: Path, capsys) -> None:
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    args = ["analyze", "curves", str(sweep), "--where", "params.lambda_p=0.4", "--by", "algorithm", "--panels"]
    assert main([*args, "params.tau", "--metrics", "gm_accuracy", "--out", str(png), "--json", str(out)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    doc = json.loads(out.read_text())
    assert doc["panels"] == "params.tau"
    assert sorted(doc["groups"]) == ["scd tau=0.2", "scd tau=0.4"]  # one group per panel value
    assert {g["name"] for g in doc["groups"].values()} == {"scd"}  # drawn in one colour in both rows
    g = doc["groups"]["scd tau=0.2"]
    assert g["panel"] == 0.2 and g["seeds"] == [0, 1]
    assert g["gm_accuracy"]["mean"] == pytest.approx([0.25, 0.35, 0.45])
    again = ["analyze", "curves", str(sweep), "--panels", "params.tau", "--against", "params.tau"]
    assert main([*again, "--out", str(png)]) == 2
    assert "--panels draws curves against rounds" in capsys.readouterr().err


def test_base_algorithm_panels_put_a_method_and_its_regularized_variants_together(tmp_path: Path) -> None:
    root = tmp_path / "asd"
    for algorithm, acc in (("fedavg", 0.5), ("fedavg+asd", 0.6), ("fedprox", 0.4), ("fedprox+asd", 0.45)):
        folder = root / algorithm
        folder.mkdir(parents=True)
        cfg = json.loads(RunConfig.from_mapping(dict(algorithm=algorithm, rounds=2)).to_json())
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / "results.jsonl").write_text(
            "".join(json.dumps({"round": r, "gm_accuracy": acc}) + "\n" for r in (1, 2))
        )
    out = tmp_path / "b.json"
    args = [
        "analyze",
        "curves",
        str(root),
        "--by",
        "algorithm",
        "--panels",
        "base_algorithm",
        "--metrics",
        "gm_accuracy",
    ]
    assert main([*args, "--out", str(tmp_path / "b.png"), "--json", str(out)]) == 0
    groups = json.loads(out.read_text())["groups"]
    assert {g["name"]: g["panel"] for g in groups.values()} == {
        "fedavg": "fedavg",
        "fedavg+asd": "fedavg",
        "fedprox": "fedprox",
        "fedprox+asd": "fedprox",
    }
    assert groups["fedavg+asd base_algorithm=fedavg"]["gm_accuracy"]["mean"] == [0.6, 0.6]
    only = tmp_path / "w.json"
    assert (
        main(
            [
                *args[:5],
                "--metrics",
                "gm_accuracy",
                "--where",
                "base_algorithm=fedprox",
                "--out",
                str(tmp_path / "w.png"),
                "--json",
                str(only),
            ]
        )
        == 0
    )
    assert sorted(json.loads(only.read_text())["groups"]) == ["fedprox", "fedprox+asd"]

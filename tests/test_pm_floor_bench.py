"""``benchmarks/pm_floor.py`` end to end on a short run: three real federations per repetition, the floor
holds for every client's wait-free PM, compute-and-wait trains one PM epoch a round, and it is all saved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_pm_floor_bench_short(repo: Path, tmp_path: Path) -> None:
    args = ["--smoke", "--out", str(tmp_path / "results"), "--runs", str(tmp_path / "runs")]  # 2 rounds, floor 7
    p = subprocess.run(
        [sys.executable, "benchmarks/pm_floor.py", *args], cwd=repo, capture_output=True, text=True, timeout=540
    )
    assert p.returncode == 0, p.stdout + p.stderr
    (saved,) = (tmp_path / "results").glob("*.json")
    doc = json.loads(saved.read_text())
    assert saved.with_suffix(".md").read_text().count("| 1 |") == 3
    assert len(doc["loadavg_before"]) == len(doc["loadavg_after"]) == 3
    runs = {r["setting"]: r for r in doc["runs"]}
    assert list(runs) == ["wait-free", "compute-and-wait", "wait-free, pm_min_steps=7"]
    for r in runs.values():
        assert r["rounds"] == 2 and 0.0 <= r["pm_accuracy"] <= 1.0 and r["wall_s"] > 0
        assert sorted(r["clients"]) == [f"client-{i}" for i in range(4)]
        assert all(c["test"] > 0 for c in r["clients"].values())
    assert all(c["pm_steps_min"] >= 7 for c in runs["wait-free, pm_min_steps=7"]["clients"].values())
    assert all(c["pm_steps_min"] == c["pm_steps_max"] > 0 for c in runs["compute-and-wait"]["clients"].values())


@pytest.mark.parametrize("bad", [["--reps", "0"], ["--floor", "0"], ["--rounds", "0"]])
def test_pm_floor_bench_refuses_bad_arguments(repo: Path, bad: list[str]) -> None:
    p = subprocess.run([sys.executable, "benchmarks/pm_floor.py", *bad], cwd=repo, capture_output=True, text=True)
    assert p.returncode == 2 and bad[0] in p.stderr, p.stderr

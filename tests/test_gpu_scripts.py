"""The GPU scripts where CUDA is absent: ``benchmarks/gpu_fleet.sh`` says so and exits 2; run on the CPU,
``gpu_fleet.py`` with a small fleet finishes its rounds and saves what it measured, and ``gpu_check.py``'s
smoke check passes its checks (the PM stops at the broadcast, overlaps the upload, and trains on after
its client's tensors went to host memory and came back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    p = subprocess.run(
        ["bash", "benchmarks/gpu_fleet.sh", "--json", str(out)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WAFL_PYTHON": sys.executable},
    )
    assert p.returncode == 2, p.stderr
    assert "CUDA is not available" in p.stderr and not out.exists()


def test_a_small_fleet_on_the_cpu_finishes_and_is_recorded(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    args = ["--smoke", "--json", str(out)]  # the CPU, 4 clients of the cnn in 2 workers of 1 slot, 2 rounds
    p = subprocess.run(
        [sys.executable, "benchmarks/gpu_fleet.py", *args], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["ok"] and r["rounds"] == 2 and len(r["round_s"]) == 2 and r["rounds_per_hour"] > 0
    assert r["workers_done"] == 2 and r["resident_max"] is None  # no accelerator: nothing moves
    assert r["gm_accuracy"] > 0.1  # ten classes
    assert "rounds per hour" in out.with_suffix(".md").read_text()


def test_gpu_check_smoke_on_the_cpu_passes_its_checks(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    args = ["--smoke", "--json", str(out)]  # the CPU, the cnn, 2 GM and 2 PM steps of 8
    p = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", *args], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["checks"] == {"pm_stopped_after_broadcast": True, "pm_overlapped_upload": True, "onload_trains_on": True}
    assert r["residency"]["pm_steps_after_onload"] == 2

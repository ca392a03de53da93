"""``benchmarks/chaos.py --smoke``: six real clients and a server under a seeded schedule of faults for a minute
(kills with and without state, the server killed and resumed, clients stopped inside an upload, a client away
for three round deadlines; as root also links dropped and cut mid-upload on shaped links), and every target of
the chaos test holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["sync", "buffered"])
def test_chaos_smoke(repo: Path, tmp_path: Path, aggregation: str) -> None:
    out, runs = tmp_path / "results", tmp_path / "runs"
    args = ["--smoke", "--aggregation", aggregation, "--seed", "1", "--out", str(out), "--runs", str(runs)]
    p = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", *args], cwd=repo, capture_output=True, text=True, timeout=540
    )
    (saved,) = out.glob("chaos-smoke-*.json")
    doc = json.loads(saved.read_text())
    (r,) = doc["runs"]
    assert len(doc["commit"]) == 40 and doc["seed"] == 1 and doc["smoke"]
    assert r["aggregation"] == aggregation and r["clients"] == 6
    kinds = {"client_kill_state", "client_kill_nostate", "server_kill", "mid_upload_stop", "client_away"}
    if os.geteuid() == 0:  # shaped links, and the faults on them
        assert r["link_rate"] == "20mbit"
        kinds |= {"link_drop", "mid_upload_cut"}
    done = [f for f in r["faults"] if "skipped" not in f]
    assert {f["kind"] for f in done} == kinds, r["faults"]
    assert not r["faults_missed"], r["faults_missed"]
    assert r["server_incarnations"] >= 2
    assert len(r["restarts"]) >= 3 and r["versions"] > 0 and r["versions_per_minute"] > 0
    assert sorted(r["client_share"]) == [f"client-{i}" for i in range(6)]
    assert abs(sum(r["client_share"].values()) - 1.0) < 1e-3
    assert r["uploads_acked"] > 0 and r["uploads_accepted"] >= r["uploads_acked"]
    for field in ("lost", "doubled", "tracebacks", "longest_stall_s", "stall_limit_s", "restarts", "targets"):
        assert field in r
    assert set(r["targets"]) == {
        "no_stall_over_two_deadlines",
        "no_update_lost_or_doubled",
        "no_traceback",
        "clients_back_within_one_round",
        "no_process_died",
    }
    # the targets themselves: what the run printed says which failed and why
    assert r["passed"] and doc["passed"] and p.returncode == 0, p.stdout + p.stderr[-3000:]


def test_chaos_refuses_bad_arguments(repo: Path) -> None:
    for bad in (["--minutes", "0"], ["--clients", "1"], ["--down-min", "5", "--down-max", "1"]):
        p = subprocess.run([sys.executable, "benchmarks/chaos.py", *bad], cwd=repo, capture_output=True, text=True)
        assert p.returncode == 2 and bad[0] in p.stderr, p.stderr

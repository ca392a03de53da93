"""``wafl bench async``'s figures from run folders: time to target, and buffered accuracy read at
the sync run's number of client updates and at its wall-clock, against hand computation."""

import json
from pathlib import Path

import pytest
from wafl.cli.experiments.bench_async import compare, summarize


def _run(folder: Path, points: list[tuple[float, float]], round_s: float = 1.0) -> Path:
    """A run folder whose version ``i`` (from 1) was published ``points[i-1][0]`` s after round 1 opened."""
    folder.mkdir(parents=True)
    start = 10.0  # server seconds at which round 1 opened
    rows = [
        {"round": i, "wall_s": start + t, "round_s": (t if i == 1 else round_s), "gm_accuracy": a}
        for i, (t, a) in enumerate(points, 1)
    ]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_buffered_accuracy_read_at_equal_updates_and_equal_time(tmp_path: Path) -> None:
    sync = summarize(_run(tmp_path / "s", [(10.0, 0.5), (20.0, 0.91), (30.0, 0.95)]), target=0.9)
    assert (sync["time_to_target_s"], sync["final_gm_accuracy"], sync["total_s"]) == (20.0, 0.95, 30.0)
    buffered_points = [(2.0 * i, a) for i, a in enumerate([0.3, 0.6, 0.9, 0.92, 0.93, 0.94, 0.96, 0.97], 1)]
    buffered_points += [(31.0, 0.99)]  # published after the sync run's wall-clock: not read
    b = summarize(_run(tmp_path / "b", buffered_points), 0.9, equal_updates=4, sync_total_s=sync["total_s"])
    assert b["time_to_target_s"] == 6.0 and b["gm_at_equal_updates"] == 0.92 and b["gm_at_sync_time"] == 0.97
    assert b["final_gm_accuracy"] == 0.99
    c = compare({"sync-wait-free": sync, "buffered-wait-free": b})["wait-free"]
    assert c["speedup_to_target"] == pytest.approx(20.0 / 6.0, abs=1e-4)
    assert c["final_difference_equal_updates"] == pytest.approx(0.92 - 0.95)
    assert c["final_difference_equal_time"] == pytest.approx(0.97 - 0.95)
    assert c["target_met_equal_updates"] is False and c["target_met_equal_time"] is True


def test_target_needs_the_speedup_as_well(tmp_path: Path) -> None:
    sync = summarize(_run(tmp_path / "s", [(10.0, 0.91), (20.0, 0.93)]), target=0.9)
    b = summarize(_run(tmp_path / "b", [(8.0, 0.92), (16.0, 0.95)]), 0.9, equal_updates=2, sync_total_s=20.0)
    c = compare({"sync-compute-and-wait": sync, "buffered-compute-and-wait": b})["compute-and-wait"]
    assert c["speedup_to_target"] == 1.25 and c["final_difference_equal_time"] == pytest.approx(0.02)
    assert not c["target_met_equal_time"] and not c["target_met_equal_updates"]

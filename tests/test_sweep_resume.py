"""An in-process sweep point killed part-way (SIGKILL, in a subprocess) resumes from its last snapshot when it
runs again: the lines written before the snapshot stay as they were, and the point's results lines and
``point.json`` are those of an uninterrupted run (timing fields and the run's random id aside), for FedAvg,
SCD under compute-and-wait (a PM, its optimizer, its reports a round late), SCAFFOLD (the clients' control
variates) under partial participation, FedProx+ASD, and clients in slot processes; a point with the plateau
rule stops at the same round. A kill inside a snapshot's write leaves the one before it; a snapshot that
cannot be used, or a point that cannot resume exactly, starts again from round 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from wafl.cli.experiments.sweep import DONE, run_point
from wafl.cli.sim.resume import FOLDER, STATE, Snapshots, not_resumable
from wafl.common.config import RunConfig, load_config

pytestmark = pytest.mark.timeout(600)
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

# the first sitting: a sweep point whose process is killed once results.jsonl has its line of round KILL_AFTER
KILLED_AFTER_A_LINE = """
import os, signal, sys
from wafl.server.results import ResultsLog

flush = ResultsLog._flush

def flush_then_die(self):
    flush(self)
    if self.rows and self.rows[-1]["round"] >= int(sys.argv[4]):
        os.kill(os.getpid(), signal.SIGKILL)

ResultsLog._flush = flush_then_die
from wafl.cli.experiments.sweep import run_point
run_point(sys.argv[1], sys.argv[2], False, int(sys.argv[3]), 1)
"""

# the first sitting killed inside the write of a snapshot: the temporary file of the one of round KILL_AFTER is
# complete, its rename into state.pt has not happened
KILLED_IN_A_SNAPSHOT = """
import os, signal, sys

rename, renamed = os.replace, []

def replace(src, dst):
    if str(dst).endswith("state.pt"):
        renamed.append(dst)
        if len(renamed) == int(sys.argv[4]):
            os.kill(os.getpid(), signal.SIGKILL)
    return rename(src, dst)

os.replace = replace
from wafl.cli.experiments.sweep import run_point
run_point(sys.argv[1], sys.argv[2], False, int(sys.argv[3]), 1)
"""


def _cfg(**fields: Any) -> RunConfig:
    return load_config(None, {"dataset": "digits", "num_clients": 6, "rounds": 6, "seed": 0, **fields})


def _lines(folder: Path) -> list[str]:
    return (folder / "results.jsonl").read_text().splitlines()


def _untimed(line: str) -> dict[str, Any]:
    row = json.loads(line)
    return {k: v for k, v in row.items() if not (k.endswith("_s") or k in ("timestamp", "run_id"))}


def _first_sitting(script: str, cfg: RunConfig, folder: Path, slot_processes: int, kill_after: int) -> list[str]:
    folder.mkdir(parents=True)
    args = [cfg.to_json(), str(folder), str(slot_processes), str(kill_after)]
    p = subprocess.run([sys.executable, "-c", script, *args], env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert not (folder / DONE).exists() and (folder / FOLDER / STATE).exists()
    return _lines(folder)


def _uninterrupted(cfg: RunConfig, folder: Path, slot_processes: int = 0) -> dict[str, Any]:
    folder.mkdir(parents=True)
    result = run_point(cfg.to_json(), str(folder), False, slot_processes, 1)
    assert result["ok"]
    return result


def _same_point(resumed: Path, whole: Path) -> None:
    """The resumed point's lines and point.json against the uninterrupted point's."""
    got, want = _lines(resumed), _lines(whole)
    assert [_untimed(x) for x in got] == [_untimed(x) for x in want]
    assert len({json.loads(x)["run_id"] for x in got}) == 1  # one run, resumed under its own id
    a, b = (json.loads((f / DONE).read_text()) for f in (resumed, whole))
    assert a.keys() == b.keys() and {**a, "wall_s": 0} == {**b, "wall_s": 0}
    assert not (resumed / FOLDER).exists()  # the snapshots go once the point is done


CASES = {
    "fedavg": ({}, 0),
    "scd": ({"algorithm": "scd", "protocol": "compute-and-wait", "fraction": 0.5, "checkpoint": False}, 0),
    "scaffold": ({"algorithm": "scaffold", "fraction": 0.5}, 0),
    "fedprox+asd": ({"algorithm": "fedprox+asd", "checkpoint": False}, 0),
    "scd-slot-processes": ({"algorithm": "scd", "protocol": "compute-and-wait"}, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_point_killed_after_round_3_resumes_with_the_lines_of_an_uninterrupted_run(case: str, tmp_path: Path) -> None:
    fields, slots = CASES[case]
    cfg = _cfg(**fields)
    assert not_resumable(cfg) is None
    killed = _first_sitting(KILLED_AFTER_A_LINE, cfg, tmp_path / "point", slots, 3)
    assert len(killed) == 3
    result = run_point(cfg.to_json(), str(tmp_path / "point"), False, slots, 1)
    assert result["ok"]
    # the lines of the rounds before the snapshot it resumed from were not written again (their wall_s)
    assert _lines(tmp_path / "point")[:2] == killed[:2]
    _uninterrupted(cfg, tmp_path / "whole", slots)
    _same_point(tmp_path / "point", tmp_path / "whole")


@pytest.mark.parametrize(
    "fields, stop",
    [
        ({"plateau_window": 3}, 6),  # the GM rule holds as soon as it is defined: round 2W
        ({"plateau_window": 2, "algorithm": "scd", "protocol": "compute-and-wait"}, 5),  # the PM's: 2W + 1
    ],
)
def test_a_plateau_point_resumed_inside_its_windows_stops_where_the_uninterrupted_one_stops(
    fields: dict[str, Any], stop: int, tmp_path: Path
) -> None:
    cfg = _cfg(rounds=10, plateau_delta=100.0, **fields)
    killed = _first_sitting(KILLED_AFTER_A_LINE, cfg, tmp_path / "point", 0, 3)
    result = run_point(cfg.to_json(), str(tmp_path / "point"), False, 0, 1)
    assert _lines(tmp_path / "point")[:2] == killed[:2]
    assert result["ok"] and result["stop_reason"] == "plateau" and result["rounds_run"] == stop
    whole = _uninterrupted(cfg, tmp_path / "whole")
    assert whole["rounds_run"] == stop
    _same_point(tmp_path / "point", tmp_path / "whole")


def test_a_kill_inside_a_snapshots_write_leaves_the_one_before_it(tmp_path: Path) -> None:
    cfg = _cfg(algorithm="scaffold")
    killed = _first_sitting(KILLED_IN_A_SNAPSHOT, cfg, tmp_path / "point", 0, 3)  # in round 3's snapshot
    assert any(".tmp" in p.name for p in (tmp_path / "point" / FOLDER).iterdir())
    found = Snapshots(tmp_path / "point", cfg).found
    assert found is not None and found.round == 2
    assert not any(".tmp" in p.name for p in (tmp_path / "point" / FOLDER).iterdir())
    assert run_point(cfg.to_json(), str(tmp_path / "point"), False, 0, 1)["ok"]
    assert _lines(tmp_path / "point")[:2] == killed[:2]
    _uninterrupted(cfg, tmp_path / "whole")
    _same_point(tmp_path / "point", tmp_path / "whole")


def test_a_snapshot_that_cannot_be_used_starts_the_point_from_round_1(tmp_path: Path) -> None:
    cfg = _cfg()
    point = tmp_path / "point"
    _first_sitting(KILLED_AFTER_A_LINE, cfg, point, 0, 3)
    assert Snapshots(point, _cfg(lr=0.01)).found is None  # another configuration's
    state = point / FOLDER / STATE
    state.write_bytes(state.read_bytes()[:-10])  # a damaged file
    assert Snapshots(point, cfg).found is None
    assert run_point(cfg.to_json(), str(point), False, 0, 1)["ok"]
    log = [json.loads(x) for x in (point / "logs" / "run.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "resume.unusable" for e in log)
    assert not any(e.get("event") == "resume.snapshot" for e in log)
    _uninterrupted(cfg, tmp_path / "whole")
    _same_point(point, tmp_path / "whole")


def test_points_that_cannot_resume_exactly_say_why_and_take_no_snapshots(tmp_path: Path) -> None:
    assert not_resumable(_cfg()) is None  # FedAvg trains no PM: wait-free trains as compute-and-wait
    assert not_resumable(_cfg(algorithm="scd", protocol="compute-and-wait")) is None
    assert "timing" in (not_resumable(_cfg(algorithm="scd")) or "")
    assert "timing" in (not_resumable(_cfg(algorithm="ditto", protocol="adaptive")) or "")
    assert "order" in (not_resumable(_cfg(aggregation="buffered")) or "")
    assert "new" in (not_resumable(_cfg(new_clients=1)) or "")
    with pytest.raises(ValueError, match="cannot resume"):
        Snapshots(tmp_path, _cfg(algorithm="scd"))
    cfg = _cfg(algorithm="scd", rounds=2)  # wait-free
    assert run_point(cfg.to_json(), str(tmp_path / "p"), False, 0, 1)["ok"]
    assert not (tmp_path / "p" / FOLDER).exists()


# every other algorithm of the Fashion-MNIST tables' rows (configs/sweeps/*_fmnist_plateau.toml), whose server
# or client state a snapshot must carry: FedGen's generator, FedDyn's gradients, pFedMe's and Ditto's PMs,
# FedRoD's and FedRep's heads, FedHKD's hyper-knowledge, MOON's previous model, FedProto's prototypes, ...
TABLE_ALGORITHMS = [
    "ditto",
    "fedalign",
    "fedavgm",
    "fedbabu",
    "feddyn",
    "feddyn+asd",
    "fedgen",
    "fedhkd",
    "fedmd",
    "fedntd",
    "fedproto-avg",
    "fedrep",
    "fedrod",
    "fedsam",
    "fedspeed",
    "moon",
    "pfedme",
]


@pytest.mark.parametrize("algorithm", TABLE_ALGORITHMS)
def test_every_table_algorithm_resumes_with_the_lines_of_an_uninterrupted_run(algorithm: str, tmp_path: Path) -> None:
    cfg = _cfg(algorithm=algorithm, protocol="compute-and-wait", fraction=0.5, rounds=5, checkpoint=False)
    assert not_resumable(cfg) is None
    killed = _first_sitting(KILLED_AFTER_A_LINE, cfg, tmp_path / "point", 0, 3)
    assert len(killed) == 3
    assert run_point(cfg.to_json(), str(tmp_path / "point"), False, 0, 1)["ok"]
    _uninterrupted(cfg, tmp_path / "whole")
    _same_point(tmp_path / "point", tmp_path / "whole")


@pytest.mark.parametrize(
    ("algorithm", "params"),
    [("fedspeed", {"dual_mean": "all"}), ("ditto", {})],
)
def test_a_decayed_clipped_point_resumes_with_the_lines_of_an_uninterrupted_run(
    algorithm: str, params: dict[str, Any], tmp_path: Path
) -> None:
    """The ASD plateau tables' recipe (``lr_decay``, ``grad_clip``) with FedSpeed's server-kept duals and with a PM
    whose optimizer lives across rounds: the resumed point takes each round's rate as the uninterrupted one does."""
    cfg = _cfg(
        algorithm=algorithm,
        params=params,
        protocol="compute-and-wait",
        fraction=0.5,
        rounds=5,
        lr_decay=0.8,
        grad_clip=10.0,
        checkpoint=False,
    )
    assert not_resumable(cfg) is None
    assert len(_first_sitting(KILLED_AFTER_A_LINE, cfg, tmp_path / "point", 0, 3)) == 3
    assert run_point(cfg.to_json(), str(tmp_path / "point"), False, 0, 1)["ok"]
    _uninterrupted(cfg, tmp_path / "whole")
    _same_point(tmp_path / "point", tmp_path / "whole")

"""``wafl bench protocols``: the figures of protocols.json on hand-computed timelines, and a short real run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from wafl.cli.experiments import bench
from wafl.cli.report import run_records
from wafl.cli.report import timeline_stats as stats
from wafl.common.config import RunConfig, load_config


def _ev(phase: str, rnd: int, start: float, end: float) -> dict[str, Any]:
    return {"phase": phase, "round": rnd, "start_s": start, "end_s": end}


# Two clients, two compute-and-wait rounds, each on its own clock. Events are listed out of
# order on purpose: nothing may depend on the order timelines.json happens to use.
TIMELINES: dict[str, Any] = {
    "client-a": {
        "client_start_unix": 1000.0,
        "events": [
            _ev("gm_train", 1, 0.0, 4.0),
            _ev("pm_train", 1, 4.0, 6.0),
            _ev("upload", 1, 6.0, 7.0),
            _ev("idle", 1, 7.0, 9.0),
            _ev("evaluate", 1, 9.0, 9.5),
            _ev("idle", 2, 16.0, 17.0),
            _ev("gm_train", 2, 9.5, 13.5),
            _ev("pm_train", 2, 13.5, 15.5),
            _ev("upload", 2, 15.5, 16.0),
            _ev("evaluate", 2, 17.0, 17.5),
        ],
    },
    "client-b": {
        "client_start_unix": 1000.5,
        "events": [
            _ev("gm_train", 1, 0.0, 5.0),
            _ev("pm_train", 1, 5.0, 7.0),
            _ev("upload", 1, 7.0, 8.0),
            _ev("idle", 1, 8.0, 9.0),
            _ev("evaluate", 1, 9.0, 9.2),
            _ev("gm_train", 2, 9.2, 12.0),
            _ev("pm_train", 2, 12.0, 14.0),
            _ev("upload", 2, 14.0, 16.0),
            _ev("idle", 2, 16.0, 17.0),
            _ev("evaluate", 2, 17.0, 17.2),
        ],
    },
}

REPORTS: list[dict[str, Any]] = [
    {"client": "client-b", "round": 1, "t_s": 10.0, "pm_accuracy": 0.9, "pm_test_samples": 300.0},
    {"client": "client-a", "round": 1, "t_s": 11.0, "pm_accuracy": 0.5, "pm_test_samples": 100.0},
    {"client": "client-a", "round": 2, "t_s": 20.0, "pm_accuracy": 0.7, "pm_test_samples": 100.0},
    {"client": "client-a", "round": 2, "t_s": 20.5, "final": 1.0, "bytes_up": 123.0},
    {"client": "client-b", "round": 2, "t_s": 21.0, "pm_accuracy": 0.95, "pm_test_samples": 300.0},
]

ROWS: list[dict[str, Any]] = [
    {"round": 1, "wall_s": 12.5, "round_s": 7.5, "pm_accuracy": 0.8},
    {"round": 2, "wall_s": 21.5, "round_s": 9.0, "pm_accuracy": 0.8875},
]


def test_idle_fraction_sums_idle_over_client_wall_time() -> None:
    # idle: a 2 + 1, b 1 + 1; wall: a 17.5 - 0, b 17.2 - 0
    assert stats.idle_fraction(TIMELINES) == pytest.approx(5.0 / 34.7)


def test_idle_fraction_wall_starts_at_first_phase() -> None:
    tl = {"c": {"events": [_ev("gm_train", 1, 10.0, 14.0), _ev("idle", 1, 14.0, 15.0), _ev("evaluate", 1, 15.0, 20.0)]}}
    assert stats.idle_fraction(tl) == pytest.approx(1.0 / 10.0)
    assert stats.idle_fraction({}) is None


def test_untracked_fraction_counts_time_in_no_phase() -> None:
    assert stats.untracked_fraction(TIMELINES) == pytest.approx(0.0)
    # covered: [0, 6] (gm and an overlapping upload, then idle), [6.5, 7], [7.2, 10]
    tl = {
        "c": {
            "events": [
                _ev("gm_train", 1, 0.0, 4.0),
                _ev("upload", 1, 3.0, 5.0),
                _ev("idle", 1, 5.0, 6.0),
                _ev("evaluate", 1, 6.5, 7.0),
                _ev("gm_train", 2, 7.2, 10.0),
            ]
        }
    }
    assert stats.untracked_fraction(tl) == pytest.approx(0.7 / 10.0)


def test_phase_medians() -> None:
    assert sorted(stats.phase_durations(TIMELINES, "gm_train")) == pytest.approx([2.8, 4.0, 4.0, 5.0])
    assert stats.median(stats.phase_durations(TIMELINES, "gm_train")) == pytest.approx(4.0)
    assert stats.median(stats.phase_durations(TIMELINES, "pm_train")) == pytest.approx(2.0)
    assert stats.median(stats.phase_durations(TIMELINES, "upload")) == pytest.approx(1.0)  # 0.5, 1, 1, 2
    assert stats.median([]) is None


def test_comm_is_the_last_uploaders_span_per_round() -> None:
    # round 1: a 9 - 6 = 3, b 9 - 7 = 2 -> 2; round 2: a 17 - 15.5 = 1.5, b 17 - 14 = 3 -> 1.5
    assert stats.comm_durations(TIMELINES) == pytest.approx([2.0, 1.5])
    assert stats.median(stats.comm_durations(TIMELINES)) == pytest.approx(1.75)


def test_ideal_speedup() -> None:
    assert stats.ideal_speedup(4.0, 2.0, 1.75) == pytest.approx(7.75 / 5.75)
    assert stats.ideal_speedup(3.0, 0.0, 1.0) == pytest.approx(1.0)
    assert stats.ideal_speedup(None, 2.0, 1.0) is None


def test_pm_curve_weights_latest_reports_by_test_size() -> None:
    curve = stats.pm_accuracy_curve(REPORTS)
    # t=10: only b has reported -> no point; t=11: (0.5*100 + 0.9*300)/400; t=20: a's newer 0.7; t=21: b's 0.95
    assert [t for t, _ in curve] == [11.0, 20.0, 21.0]
    assert [a for _, a in curve] == pytest.approx([0.8, 0.85, 0.8875])


def test_zeta_is_the_first_crossing_after_start() -> None:
    curve = stats.pm_accuracy_curve(REPORTS)
    t0 = stats.training_start(ROWS)
    assert t0 == pytest.approx(5.0)
    # b alone is at 0.9 at t=10, but the metric needs every client: the first point is t=11
    assert stats.zeta_total(curve, 0.5, t0) == pytest.approx(6.0)
    assert stats.zeta_total(curve, 0.85, t0) == pytest.approx(15.0)
    assert stats.zeta_total(curve, 0.86, t0) == pytest.approx(16.0)
    assert stats.zeta_total(curve, 0.95, t0) is None


def test_pm_curve_falls_back_to_round_rows() -> None:
    rows = [
        {"round": 1, "wall_s": 3.0, "pm_accuracy": 0.4},
        {"round": 2, "wall_s": 5.0, "pm_accuracy": None},
        {"round": 3, "wall_s": 7.0, "pm_accuracy": 0.6},
    ]
    assert stats.pm_accuracy_curve([{"client": "c", "t_s": 7.5, "final": 1.0}], rows) == [(3.0, 0.4), (7.0, 0.6)]


def test_summarize_run_and_compare(tmp_path: Path) -> None:
    run = tmp_path / "compute-and-wait"
    run.mkdir()
    (run / "timelines.json").write_text(json.dumps(TIMELINES))
    (run / "reports.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REPORTS))
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    s = bench.summarize_run(run, target=0.85)
    assert s["total_s"] == pytest.approx(16.5)
    assert s["rounds"] == 2
    assert s["round_s"] == pytest.approx(8.25)
    assert s["idle_fraction"] == pytest.approx(5.0 / 34.7, abs=1e-5)
    assert s["zeta_total_s"] == pytest.approx(15.0)
    assert (s["t_gm_s"], s["t_pm_s"], s["t_comm_s"]) == pytest.approx((4.0, 2.0, 1.75))
    wf = {"total_s": 11.0, "zeta_total_s": 10.0, "rounds": 2}
    c = bench.compare({"compute-and-wait": s, "wait-free": wf})
    assert c["speedup"] == pytest.approx(1.5)
    # wait-free ran more rounds in the same time: the speedup compares time per round
    assert bench.compare({"compute-and-wait": s, "wait-free": {**wf, "rounds": 3}})["speedup"] == pytest.approx(2.25)
    # the rounds that fit in compute-and-wait's time at the ideal speedup 7.75 / 5.75
    assert bench.equal_time_rounds(2, s) == 3 and bench.equal_time_rounds(10, s) == 14
    assert bench.equal_time_rounds(10, {}) == 10
    assert c["ideal_speedup"] == pytest.approx(7.75 / 5.75, abs=1e-4)
    assert c["speedup_vs_ideal"] == pytest.approx(1.5 / (7.75 / 5.75), abs=1e-3)
    assert c["zeta_speedup"] == pytest.approx(1.5)
    assert s["gm_cpu_per_step_s"] is None and c["gm_cpu_per_step_ratio"] is None  # no client logs in this run
    # adaptive against the better of the two (compute-and-wait 15 s, wait-free 10 s); no ratio when it missed
    assert "adaptive_zeta_vs_best" not in c
    with_adaptive = bench.compare({"compute-and-wait": s, "wait-free": wf, "adaptive": {"zeta_total_s": 10.5}})
    assert with_adaptive["adaptive_zeta_vs_best"] == pytest.approx(1.05)
    missed = bench.compare({"compute-and-wait": s, "wait-free": wf, "adaptive": {"zeta_total_s": None}})
    assert missed["adaptive_zeta_vs_best"] is None
    assert bench.adaptive_vs_best({"compute-and-wait": 15.0, "wait-free": 10.0, "adaptive": None}) == math.inf


def test_gm_cpu_per_step_from_the_clients_logs(tmp_path: Path) -> None:
    """The median over GM phases of process CPU per step and per wall-clock second, from every client's log;
    other lines, PM phases and phases without steps do not count."""
    logs = tmp_path / "logs"
    logs.mkdir()
    a = [
        {"event": "gm.trained", "round": 1, "steps": 10, "wall_s": 2.0, "process_cpu_s": 0.8},  # 80 ms, 0.4
        {"event": "pm.trained", "round": 1, "steps": 5, "wall_s": 9.0, "process_cpu_s": 0.1},
        {"event": "gm.trained", "round": 2, "steps": 10, "wall_s": 2.5, "process_cpu_s": 1.0},  # 100 ms, 0.4
        {"event": "run.final", "round": 2},
    ]
    b = [
        {"event": "gm.trained", "round": 1, "steps": 20, "wall_s": 6.0, "process_cpu_s": 1.8},  # 90 ms, 0.3
        {"event": "gm.trained", "round": 2, "steps": 0, "wall_s": 0.1, "process_cpu_s": 0.0},  # no step: left out
    ]
    for name, rows in (("client-0", a), ("client-1", b)):
        (logs / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (logs / "server.jsonl").write_text(json.dumps({"event": "gm.trained", "steps": 1, "wall_s": 1, "process_cpu_s": 9}))
    phases = run_records.trained_phases(logs)
    assert [p["round"] for p in phases] == [1, 2, 1, 2]
    per_step, per_wall = stats.cpu_per_step(phases)
    assert per_step == pytest.approx(0.09) and per_wall == pytest.approx(0.4)
    assert stats.cpu_per_step(run_records.trained_phases(logs, "pm.trained")) == pytest.approx((0.02, 0.1 / 9))
    c = bench.compare({"compute-and-wait": {"gm_cpu_per_step_s": 0.08}, "wait-free": {"gm_cpu_per_step_s": 0.09}})
    assert c["gm_cpu_per_step_ratio"] == pytest.approx(1.125)


def _by_round(events: list[dict[str, Any]], phase: str) -> dict[int, dict[str, Any]]:
    return {int(e["round"]): e for e in events if e["phase"] == phase}


@pytest.mark.slow
def test_bench_protocols_end_to_end(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        {
            "dataset": "digits",
            "algorithm": "ditto",
            "num_clients": 2,
            "rounds": 2,
            "local_epochs": 1,
            "pm_epochs": 1,
            "seed": 0,
        },
    )
    code = bench.bench_protocols(cfg, tmp_path, target=0.3, show_progress=False, timeout_s=300.0)
    assert code == 0
    doc = json.loads((tmp_path / "protocols.json").read_text())
    assert set(doc["protocols"]) == {"compute-and-wait", "wait-free"}
    for name, p in doc["protocols"].items():
        for key in ("total_s", "rounds", "round_s", "idle_fraction", "zeta_total_s", "t_gm_s", "t_pm_s", "t_comm_s"):
            assert key in p, (name, key)
        assert p["rounds"] == doc["config"]["rounds_per_protocol"][name]
        assert math.isfinite(p["total_s"]) and p["total_s"] > 0
        assert 0.0 <= p["idle_fraction"] < 1.0
    assert math.isfinite(doc["speedup"]) and doc["speedup"] > 0
    # the faster client waits for the slower one under compute-and-wait, trains its PM under wait-free
    assert doc["protocols"]["wait-free"]["idle_fraction"] < doc["protocols"]["compute-and-wait"]["idle_fraction"]
    assert doc["ideal_speedup"] >= 1.0
    caw = doc["protocols"]["compute-and-wait"]
    assert doc["config"]["rounds_per_protocol"] == {
        "compute-and-wait": 2,
        "wait-free": bench.equal_time_rounds(2, caw),
    }
    for png in ("timelines.png", "pm_accuracy.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for name in ("wait-free", "compute-and-wait"):
        timelines = json.loads((tmp_path / name / "timelines.json").read_text())
        assert len(timelines) == 2
        for client, tl in timelines.items():
            uploads, pms = _by_round(tl["events"], "upload"), _by_round(tl["events"], "pm_train")
            assert set(uploads) == set(pms) == set(range(1, doc["config"]["rounds_per_protocol"][name] + 1)), (
                name,
                client,
            )
            for r in (1, 2):
                if name == "wait-free":  # the PM trains while the upload is on the wire
                    assert pms[r]["end_s"] > uploads[r]["start_s"], (client, r)
                    assert pms[r]["start_s"] < uploads[r]["end_s"], (client, r)
                else:  # the PM is done before the upload starts
                    assert pms[r]["end_s"] <= uploads[r]["start_s"], (client, r)
            # every training phase is logged with its steps, wall-clock and process CPU seconds
            lines = [json.loads(x) for x in (tmp_path / name / "logs" / f"{client}.jsonl").read_text().splitlines()]
            gms = {x["round"]: x for x in lines if x["event"] == "gm.trained"}
            pm_lines = {x["round"]: x for x in lines if x["event"] == "pm.trained"}
            assert set(gms) == set(pm_lines) == set(uploads), (name, client)
            for r, x in gms.items():
                gm_phase = _by_round(tl["events"], "gm_train")[r]
                assert x["steps"] > 0 and x["process_cpu_s"] > 0, x
                # the logged wall-clock is the timeline's phase, to the log's four decimals
                assert x["wall_s"] == pytest.approx(gm_phase["end_s"] - gm_phase["start_s"], abs=6e-5), (x, gm_phase)
                assert pm_lines[r]["wall_s"] == pytest.approx(pms[r]["end_s"] - pms[r]["start_s"], abs=6e-5), r
            if name == "compute-and-wait":  # one PM epoch: every round the same number of steps
                assert len({x["steps"] for x in pm_lines.values()}) == 1 and pm_lines[1]["steps"] > 0


class _Model:
    def __init__(self, round: int, final: bool = False) -> None:
        self.round, self.final = round, final


async def test_wait_free_stop_signal_counts_complete_broadcasts() -> None:
    from wafl.client.protocol import _prefetch

    async def stream() -> Any:
        for r in (1, 2, 3):
            yield _Model(r)
        yield _Model(4, final=True)

    arrived: list[int] = []
    seen: list[tuple[int, int]] = []
    async for m in _prefetch(stream(), lambda: arrived.append(1)):
        seen.append((m.round, len(arrived)))
    # every broadcast is counted as it is queued, before the consumer gets to it
    assert all(n >= r for r, n in seen)
    assert len(arrived) == 4
    assert seen[-1][0] == 4


def test_model_assembler_announces_each_header() -> None:
    from wafl.client.session import ModelAssembler
    from wafl.common.proto import federation_pb2 as pb

    heads: list[int] = []
    asm = ModelAssembler((), lambda: heads.append(1))
    for r in (1, 2):
        assert asm.feed(pb.BroadcastMessage(header=pb.BroadcastHeader(round=r))) is None
        assert len(heads) == r  # announced at the header, before any of the transfer


def _own_nice() -> int:
    import os
    import threading

    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_wait_free_pm_thread_runs_at_pm_nice_and_others_do_not() -> None:
    from types import SimpleNamespace

    from wafl.client.protocol import RoundProtocol

    base = _own_nice()
    cfg = RunConfig.from_mapping({"pm_nice": max(base, 15), "num_clients": 1})  # slowdown none, dropout 0
    trainer = SimpleNamespace(algorithm=SimpleNamespace(personalized=True), cfg=cfg, index=0)
    wf = RoundProtocol(SimpleNamespace(), trainer, "wait-free")  # type: ignore[arg-type]
    caw = RoundProtocol(SimpleNamespace(), trainer, "compute-and-wait")  # type: ignore[arg-type]
    try:
        assert wf.background is not None and caw.background is None
        assert wf.background.submit(_own_nice).result(timeout=10) == max(base, 15)
        assert _own_nice() == base  # the calling thread (the event loop's) is untouched
    finally:
        wf.background.shutdown()


def test_wait_free_pm_yields_the_clients_own_transfers(tmp_path: Path) -> None:
    """``pm_yield_transfers``: the PM starts once its client's upload is done (in process, real engine)."""
    from wafl.cli.sim.simulate import simulate

    cfg = load_config(
        None,
        {
            "dataset": "digits",
            "algorithm": "ditto",
            "num_clients": 2,
            "rounds": 2,
            "local_epochs": 1,
            "protocol": "wait-free",
            "pm_yield_transfers": True,
            "checkpoint": False,
            "device": "cpu",
        },
    )
    assert len(simulate(cfg, tmp_path)) == 2
    timelines = json.loads((tmp_path / "timelines.json").read_text())
    assert len(timelines) == 2
    for client, tl in timelines.items():
        uploads, pms = _by_round(tl["events"], "upload"), _by_round(tl["events"], "pm_train")
        assert set(uploads) == set(pms) == {1, 2}, client
        for r in (1, 2):
            assert pms[r]["start_s"] >= uploads[r]["end_s"], (client, r)


def test_pm_yield_transfers_must_be_a_bool() -> None:
    from wafl.common.config import ConfigError

    with pytest.raises(ConfigError, match="pm_yield_transfers"):
        load_config(None, {"pm_yield_transfers": "yes"})


def test_process_cpu_is_read_only_for_a_written_line() -> None:
    """The phases' process CPU is read when their INFO line is written, else not at all (0.0)."""
    import logging
    import time

    from wafl.client.protocol import _process_cpu

    logger = logging.getLogger("client")
    before = logger.level
    try:
        logger.setLevel(logging.WARNING)
        assert _process_cpu() == 0.0
        logger.setLevel(logging.INFO)
        end = time.process_time() + 0.02
        while time.process_time() < end:  # some CPU, so that the process clock is above 0
            pass
        assert _process_cpu() > 0.0
    finally:
        logger.setLevel(before)

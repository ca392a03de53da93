"""The adaptive protocol's decision rule (client/adaptive.py) on hand-computed rounds, and on a re-computed
synchronous round in which several clients decide together."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from wafl.client.adaptive import AdaptivePlanner

S = 0.2  # seconds per PM step
B = 10  # budget: PM steps per round (B s = 2 s)


def _planner() -> AdaptivePlanner:
    p = AdaptivePlanner(B)
    p.observe_gm(1.0, 5)  # the prior before any PM phase: 0.2 s per step
    return p


def test_first_round_uploads_first_and_no_budget_is_wait_free() -> None:
    d = _planner().decide(1)
    assert (d.pre_steps, d.rule, d.step_s) == (0, "first-round", pytest.approx(S))
    none = AdaptivePlanner(0)
    none.observe_window(0.0, 0.01)
    assert (none.decide(2).pre_steps, none.decide(2).rule) == (0, "no-budget")


def test_slow_link_uploads_first() -> None:
    # the window after an immediate upload (5 s of upload and broadcast) holds the budget's 2 s
    p = _planner()
    p.observe_window(0.0, 5.0)
    d = p.decide(2)
    assert (d.pre_steps, d.rule, d.free_window_s) == (0, "window-holds-budget", 5.0)


def test_fast_link_last_uploader_trains_what_the_tail_does_not_hold_and_stays_there() -> None:
    # F = U + C = 0.3 s: floor(0.3 / 0.2) = 1 step fits after the upload, 9 go before it
    p = _planner()
    p.observe_window(0.0, 0.3)
    assert p.decide(2).pre_steps == 9
    # round 2 on the critical path: its 1.8 s before the upload lengthened the round, the window stayed 0.3 s;
    # V + P = 2.1 > 0.3, so the estimate (the minimum) stays 0.3 and so does the decision (no oscillation)
    p.observe_pm(1.8, 9, background=False)
    p.observe_window(1.8, 0.3)
    d = p.decide(3)
    assert (d.pre_steps, d.free_window_s) == (9, pytest.approx(0.3))


def test_fast_link_off_the_critical_path_trains_within_its_slack() -> None:
    # F = 0.3 s, slack S = 1.0 s: an immediate upload leaves 1.3 s; floor(1.3 / 0.2) = 6 steps after it, 4 before
    p = _planner()
    p.observe_window(0.0, 1.3)
    d = p.decide(2)
    assert d.pre_steps == 4 and d.pre_steps * S <= 1.0  # 0.8 s before the upload: within the slack, round not delayed
    # round 2: the window shrank by the 0.8 s it trained before uploading (V = 0.5): V + P = 1.3 again
    p.observe_pm(0.8, 4, background=False)
    p.observe_window(0.8, 0.5)
    assert p.decide(3).pre_steps == 4


def _sync_rounds(
    gm_s: list[float], upload_s: list[float], tail_s: float, rounds: int, pre: str
) -> list[tuple[float, list[float], list[int]]]:
    """A synchronous round re-computed from its definition: client i uploads at G_i + P_i, its upload ends
    U_i later, the round closes at the last upload's end and the broadcast arrives ``tail_s`` later; the
    background PM window runs from each upload's start to that arrival. ``pre``: "adaptive" (the planner
    decides P_i), "caw" (P_i = B s) or "wf" (P_i = 0). Per round: its length, each client's PM seconds
    (P_i, and V_i but under compute-and-wait) and pre-upload steps."""
    planners = [_planner() for _ in gm_s]
    out = []
    for r in range(1, rounds + 1):
        steps = [p.decide(r).pre_steps if pre == "adaptive" else (B if pre == "caw" else 0) for p in planners]
        pre_s = [k * S for k in steps]
        close = max(g + p + u for g, p, u in zip(gm_s, pre_s, upload_s, strict=True))
        arrival = close + tail_s
        windows = [arrival - (g + p) for g, p in zip(gm_s, pre_s, strict=True)]
        for p, k, ps, v in zip(planners, steps, pre_s, windows, strict=True):
            if k:
                p.observe_pm(ps, k, background=False)
            p.observe_window(ps, v)
        # compute-and-wait idles after its upload; the others train their PM until the broadcast arrives
        pm = pre_s if pre == "caw" else [ps + v for ps, v in zip(pre_s, windows, strict=True)]
        out.append((arrival, pm, steps))
    return out


@pytest.mark.parametrize(
    ("upload_s", "tail_s"),
    [([0.1, 0.1, 0.1], 0.1), ([0.4, 0.5, 0.3], 0.2), ([3.0, 3.0, 3.0], 0.5)],  # fast, middle, slow links
)
def test_re_computed_rounds_never_longer_than_compute_and_wait_budget_always_kept(
    upload_s: list[float], tail_s: float
) -> None:
    gm_s = [1.0, 2.0, 3.0]  # shards of different sizes: the third client uploads last
    rounds = 6
    ad = _sync_rounds(gm_s, upload_s, tail_s, rounds, "adaptive")
    caw = _sync_rounds(gm_s, upload_s, tail_s, rounds, "caw")
    wf = _sync_rounds(gm_s, upload_s, tail_s, rounds, "wf")
    for r in range(1, rounds):  # from round 2 on, with a window measured
        length, pm, steps = ad[r]
        assert length <= caw[r][0] + 1e-9
        assert length >= wf[r][0] - 1e-9
        assert all(x >= B * S - S - 1e-9 for x in pm), (r, pm)  # the budget, to within the one step floor() drops
        # the last uploader's share of the round: at least the better of the two protocols'
        assert pm[2] / length >= max(caw[r][1][2] / caw[r][0], wf[r][1][2] / wf[r][0]) - 1e-9
    if min(upload_s) + tail_s >= B * S:  # every window holds the budget: wait-free itself
        assert all(steps == [0, 0, 0] for _, _, steps in ad)
        assert [x[0] for x in ad] == pytest.approx([x[0] for x in wf])
    else:  # the last uploader trains before its upload what its window does not hold, the others less or nothing
        steps = ad[-1][2]
        assert steps[2] == B - math.floor((upload_s[2] + tail_s) / S + 1e-9)
        assert steps[0] <= steps[2]


def _decisions(out: Any, clients: int) -> dict[str, list[dict[str, Any]]]:
    """Every client's ``adaptive.decision`` log lines."""
    found = {}
    for i in range(clients):
        lines = [json.loads(x) for x in (out / "logs" / f"client-{i}.jsonl").read_text().splitlines()]
        found[f"client-{i}"] = [x for x in lines if x["event"] == "adaptive.decision"]
    return found


@pytest.mark.slow
def test_adaptive_run_over_grpc_records_every_decision(tmp_path: Any) -> None:
    from wafl.cli.launch.launcher import launch
    from wafl.common.config import load_config

    cfg = load_config(
        None,
        {"dataset": "digits", "algorithm": "scd", "num_clients": 3, "rounds": 3, "protocol": "adaptive", "seed": 0},
    )
    summary = launch(cfg, tmp_path, show_progress=False, timeout_s=300)
    assert summary.ok
    timelines = json.loads((tmp_path / "timelines.json").read_text())
    decisions = _decisions(tmp_path, 3)
    for client, tl in timelines.items():
        ev = tl["events"]
        marks = {e["round"]: e for e in ev if e["phase"] == "decide"}
        assert set(marks) == {1, 2, 3} and all(m["start_s"] == m["end_s"] for m in marks.values()), client
        assert [d["round"] for d in decisions[client]] == [1, 2, 3]
        assert decisions[client][0]["rule"] == "first-round" and decisions[client][0]["pre_steps"] == 0
        for d in decisions[client]:
            r, upload = d["round"], next(e for e in ev if e["phase"] == "upload" and e["round"] == d["round"])
            before = [e for e in ev if e["phase"] == "pm_train" and e["round"] == r and e["end_s"] <= upload["start_s"]]
            after = [e for e in ev if e["phase"] == "pm_train" and e["round"] == r and e["end_s"] > upload["start_s"]]
            # the decision's pre-upload PM is on the timeline between its mark and its upload; the rest follows
            assert bool(before) == (d["pre_steps"] > 0), (client, d)
            assert all(e["start_s"] >= marks[r]["start_s"] for e in before)
            assert len(after) == 1 and 0 <= d["pre_steps"] <= d["budget_steps"]


@pytest.mark.parametrize("yield_transfers", [False, True])
def test_adaptive_in_process_decides_every_round(tmp_path: Any, yield_transfers: bool) -> None:
    """The simulation shares client/protocol.py: the same marks, and with ``pm_yield_transfers`` the background
    PM starts once the upload is done."""
    from wafl.cli.sim.simulate import simulate
    from wafl.common.config import load_config

    cfg = load_config(
        None,
        {
            "dataset": "digits",
            "algorithm": "ditto",
            "num_clients": 2,
            "rounds": 3,
            "local_epochs": 1,
            "protocol": "adaptive",
            "pm_yield_transfers": yield_transfers,
            "checkpoint": False,
            "device": "cpu",
        },
    )
    assert len(simulate(cfg, tmp_path)) == 3
    for client, tl in json.loads((tmp_path / "timelines.json").read_text()).items():
        ev = tl["events"]
        assert sorted(e["round"] for e in ev if e["phase"] == "decide") == [1, 2, 3], client
        for r in (1, 2, 3):
            upload = next(e for e in ev if e["phase"] == "upload" and e["round"] == r)
            last_pm = max((e for e in ev if e["phase"] == "pm_train" and e["round"] == r), key=lambda e: e["end_s"])
            assert last_pm["end_s"] > upload["start_s"]  # the background part follows the upload
            if yield_transfers:
                assert last_pm["start_s"] >= upload["end_s"]


@pytest.mark.slow
def test_bench_protocols_runs_all_three(tmp_path: Any) -> None:
    from wafl.cli.experiments import bench
    from wafl.cli.launch.measured import measured_hosts
    from wafl.common.config import load_config

    cfg = load_config(
        None,
        {"dataset": "digits", "algorithm": "ditto", "num_clients": 2, "rounds": 2, "local_epochs": 1, "seed": 0},
    )
    three = ["wait-free", "compute-and-wait", "adaptive"]
    hosts = measured_hosts(cfg, host_cpus="none")
    code = bench.bench_protocols(
        cfg, tmp_path, hosts, target=0.3, show_progress=False, timeout_s=300.0, protocols=three
    )
    assert code == 0
    doc = json.loads((tmp_path / "protocols.json").read_text())
    assert list(doc["protocols"]) == ["compute-and-wait", "wait-free", "adaptive"]  # the baseline first
    rounds = doc["config"]["rounds_per_protocol"]
    assert rounds["adaptive"] == rounds["wait-free"] == bench.equal_time_rounds(2, doc["protocols"]["compute-and-wait"])
    for name, p in doc["protocols"].items():
        assert p["ok"] and p["rounds"] == rounds[name] and p["total_s"] > 0, name
    assert "adaptive_zeta_vs_best" in doc
    zetas = [doc["protocols"][p]["zeta_total_s"] for p in three]
    if all(zetas):
        assert doc["adaptive_zeta_vs_best"] == pytest.approx(zetas[2] / min(zetas[:2]), abs=1e-3)
    marks = [
        e for tl in json.loads((tmp_path / "adaptive" / "timelines.json").read_text()).values() for e in tl["events"]
    ]
    assert sum(e["phase"] == "decide" for e in marks) == 2 * rounds["adaptive"]
    # compute-and-wait first, the others in the order given (a series alternates them between repetitions)
    assert bench.bench_order(["adaptive", "wait-free", "compute-and-wait"]) == [
        "compute-and-wait",
        "adaptive",
        "wait-free",
    ]
    assert bench.bench_order(["wait-free", "adaptive"]) == ["wait-free", "adaptive"]
    with pytest.raises(ValueError, match="protocols"):
        bench.bench_order(["adaptive", "adaptive"])
    with pytest.raises(ValueError, match="protocols"):
        bench.bench_order(["fastest"])

"""The plateau rule (wafl.common.plateau) against a slow re-computation from its formula, its configuration's
refusals, the evaluation schedule it forces, and runs that stop on it: in process, in a sweep point and
over gRPC (``wafl run``)."""

import json
import random
import statistics
from pathlib import Path

import pytest
from wafl.cli.sim.simulate import simulate
from wafl.common.config import ConfigError, RunConfig, load_config
from wafl.common.plateau import GM, MAX_ROUNDS, PLATEAU, PM, PlateauWatch, gap, gap_se, ran_to_end


def slow_gap(values: dict[int, float], newest: int, window: int) -> float | None:
    """The module docstring's formula, written out: every round 1..newest in turn."""
    recent, before = [], []
    for t in range(1, newest + 1):
        if t not in values:
            continue
        if newest - window < t <= newest:
            recent.append(values[t])
        elif newest - 2 * window < t <= newest - window:
            before.append(values[t])
    if newest < 2 * window or not recent or not before:
        return None
    return sum(recent) / len(recent) - sum(before) / len(before)


def slow_se(values: dict[int, float], newest: int, window: int) -> float | None:
    """The standard error of the gap, by statistics.variance over each window's evaluated rounds."""
    if newest < 2 * window:
        return None
    recent = [v for t, v in values.items() if newest - window < t <= newest]
    before = [v for t, v in values.items() if newest - 2 * window < t <= newest - window]
    if len(recent) < 2 or len(before) < 2:
        return None
    return (statistics.variance(recent) / len(recent) + statistics.variance(before) / len(before)) ** 0.5


def slow_stop(
    values: dict[int, float], evaluated: set[int], rounds: int, window: int, delta: float, lag: int, z: float = 0.0
):
    """The first evaluated round r whose windows, ending at round r - lag, lie within delta points (with z
    standard errors' room); None if none."""
    for r in range(1, rounds + 1):
        if r not in evaluated:
            continue
        known = {t: v for t, v in values.items() if t <= r - lag}
        g = slow_gap(known, r - lag, window)
        if g is None:
            continue
        if not z and abs(g) * 100 <= delta:
            return r
        se = slow_se(known, r - lag, window)
        if z and se is not None and (abs(g) + z * se) * 100 <= delta:
            return r
    return None


def test_gap_matches_a_slow_recomputation() -> None:
    rng = random.Random(5)
    for _ in range(500):
        window = rng.randint(1, 6)
        newest = rng.randint(0, 30)
        values = {t: rng.random() for t in range(1, newest + 3) if rng.random() < 0.6}  # later rounds: ignored
        got, want = gap(values, newest, window), slow_gap(values, newest, window)
        assert (got is None) == (want is None)
        if want is not None:
            assert got == pytest.approx(want, abs=1e-12)


def test_gap_se_matches_a_slow_recomputation() -> None:
    rng = random.Random(7)
    for _ in range(500):
        window = rng.randint(1, 6)
        newest = rng.randint(0, 30)
        values = {t: rng.random() for t in range(1, newest + 3) if rng.random() < 0.6}
        got, want = gap_se(values, newest, window), slow_se(values, newest, window)
        assert (got is None) == (want is None)
        if want is not None:
            assert got == pytest.approx(want, abs=1e-12)


def test_the_bound_keeps_a_noisy_rising_curve_going_that_the_plain_rule_stops() -> None:
    """A curve rising 0.15 points a round with 2 points of noise (a 10 % participation GM): with W = 10 and
    D = 0.3 the plain rule stops it early in most seeds; with z = 1.645 and the same W and D it never does."""
    plain = bounded = 0
    for seed in range(20):
        rng = random.Random(seed)
        curve = {r: 0.6 + 0.0015 * r + rng.gauss(0.0, 0.02) for r in range(1, 201)}
        everything = set(curve)
        plain += slow_stop(curve, everything, 200, 10, 0.3, 0) is not None
        bounded += slow_stop(curve, everything, 200, 10, 0.3, 0, z=1.645) is not None
    assert plain >= 15
    assert bounded == 0


@pytest.mark.parametrize("z", [0.0, 1.645])
@pytest.mark.parametrize("metric", ["gm_accuracy", "pm_accuracy"])
def test_watch_stops_where_the_slow_rule_first_holds(metric: str, z: float) -> None:
    """Curves that rise, then level off with noise; eval_every 1..window: the watch ends the run at the first
    evaluated round where the slow rule holds, records plateau_gap there and stop_reason where it ends. A PM
    line of round r that is written before round r closes (its reports came early) plays no part in round
    r's decision: the decision reads rounds up to r - 1 only, which are written by then whatever the timing."""
    rng = random.Random((11 if metric == "gm_accuracy" else 12) + int(10 * z))
    for _ in range(200):
        window = rng.randint(2 if z else 1, 5)
        rounds = rng.randint(2 * window, 40)
        every = rng.randint(1, window // 2 if z else window)
        cfg = RunConfig.from_mapping(dict(rounds=rounds, eval_every=every, plateau_window=window, plateau_z=z))
        delta = rng.choice([0.0, 0.5, 2.0, 5.0, 8.0] if z else [0.0, 0.5, 2.0, 5.0])
        level, rise = rng.uniform(0.5, 0.9), rng.randint(0, rounds)
        evaluated = {r for r in range(1, rounds + 1) if cfg.evaluates(r)}
        curve = {r: level * min(1.0, r / max(1, rise)) + rng.uniform(-0.02, 0.02) for r in evaluated}
        lag = 1 if metric == "pm_accuracy" else 0
        want = slow_stop(curve, evaluated, rounds, window, delta, lag, z)

        watch = PlateauWatch(window, delta, [metric], rounds, z)
        written = 0  # the results lines written so far (a PM watch reads them)
        stopped_at, fields = None, {}
        for r in range(1, rounds + 1):
            if metric == "pm_accuracy":
                early = rng.random() < 0.5  # round r's reports may already be in when it closes
                for t in range(written + 1, r + (1 if early else 0)):
                    watch.row({"round": t, "pm_accuracy": curve.get(t)})
                    written = t
            fields = watch.end_of_round(r, curve.get(r), r in evaluated, last=r == rounds)
            g = slow_gap({t: v for t, v in curve.items() if t <= r - lag}, r - lag, window)
            if r in evaluated and g is not None:
                assert fields["plateau_gap"] == pytest.approx(100 * g, abs=1e-5)
                se = slow_se({t: v for t, v in curve.items() if t <= r - lag}, r - lag, window)
                if z and se is not None:
                    assert fields["plateau_se"] == pytest.approx(100 * se, abs=1e-5)
                else:
                    assert "plateau_se" not in fields
            else:
                assert "plateau_gap" not in fields
            if watch.stop:
                stopped_at = r
                break
            assert fields.get("stop_reason") == (MAX_ROUNDS if r == rounds else None)
        assert stopped_at == want
        if want is not None:
            assert fields["stop_reason"] == PLATEAU


def slow_holds(values: dict[int, float], r: int, window: int, delta: float, lag: int, z: float) -> bool:
    """Whether the slow rule holds at evaluated round r for one watched accuracy (its lines up to r - lag)."""
    known = {t: v for t, v in values.items() if t <= r - lag}
    g = slow_gap(known, r - lag, window)
    if g is None:
        return False
    if not z:
        return abs(g) * 100 <= delta
    se = slow_se(known, r - lag, window)
    return se is not None and (abs(g) + z * se) * 100 <= delta


@pytest.mark.parametrize("z", [0.0, 1.645])
def test_a_watch_of_gm_and_pm_stops_only_once_both_have_flattened(z: float) -> None:
    """A GM that keeps rising after the PM has levelled off (as SCD's and FedHKD's do): the watch of both ends
    the run at the first evaluated round where the slow rule holds for the GM (its windows ending at r) and
    the PM (ending at r - 1) at once, not where it first holds for the PM, and records each one's gap."""
    rng = random.Random(21 + int(10 * z))
    later = 0
    for _ in range(200):
        window = rng.randint(2 if z else 1, 5)
        rounds = rng.randint(2 * window, 60)
        every = rng.randint(1, window // 2 if z else window)
        cfg = RunConfig.from_mapping(dict(rounds=rounds, eval_every=every, plateau_window=window, plateau_z=z))
        delta = rng.choice([0.5, 2.0, 5.0, 8.0] if z else [0.0, 0.5, 2.0, 5.0])
        evaluated = {r for r in range(1, rounds + 1) if cfg.evaluates(r)}
        rise_pm, rise_gm = rng.randint(0, rounds // 2), rng.randint(0, rounds)
        pm = {r: 0.9 * min(1.0, r / max(1, rise_pm)) + rng.uniform(-0.02, 0.02) for r in evaluated}
        gm = {r: 0.7 * min(1.0, r / max(1, rise_gm)) + rng.uniform(-0.02, 0.02) for r in evaluated}
        both = [
            r
            for r in sorted(evaluated)
            if slow_holds(gm, r, window, delta, 0, z) and slow_holds(pm, r, window, delta, 1, z)
        ]
        want = both[0] if both else None
        pm_alone = next((r for r in sorted(evaluated) if slow_holds(pm, r, window, delta, 1, z)), None)
        later += want != pm_alone

        watch = PlateauWatch(window, delta, [GM, PM], rounds, z)
        stopped_at, fields = None, {}
        for r in range(1, rounds + 1):
            if r - 1 in pm:
                watch.row({"round": r - 1, "pm_accuracy": pm[r - 1], "gm_accuracy": gm.get(r - 1)})
            fields = watch.end_of_round(r, gm.get(r), r in evaluated, last=r == rounds)
            assert "plateau_gap" not in fields and "plateau_se" not in fields
            for name, values, lag in (("gm", gm, 0), ("pm", pm, 1)):
                known = {t: v for t, v in values.items() if t <= r - lag}
                g = slow_gap(known, r - lag, window)
                if r in evaluated and g is not None:
                    assert fields[f"plateau_gap_{name}"] == pytest.approx(100 * g, abs=1e-5)
                else:
                    assert f"plateau_gap_{name}" not in fields
            if watch.stop:
                stopped_at = r
                break
        assert stopped_at == want
        assert fields["stop_reason"] == (PLATEAU if want is not None else MAX_ROUNDS)
    assert later >= 40  # the GM held many runs back past the round where the PM alone would have stopped them


def test_the_last_two_windows_before_the_maximum_are_evaluated_every_round() -> None:
    cfg = RunConfig.from_mapping(dict(rounds=50, eval_every=5, plateau_window=10))
    assert [r for r in range(1, 51) if cfg.evaluates(r)] == [5, 10, 15, 20, 25, 30, *range(31, 51)]
    off = RunConfig.from_mapping(dict(rounds=50, eval_every=5))
    assert [r for r in range(1, 51) if off.evaluates(r)] == list(range(5, 51, 5))  # without the rule: as before


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"plateau_window": -1}, r"plateau_window=-1 must be an integer >= 0"),
        ({"plateau_window": 2, "plateau_delta": -0.1}, r"plateau_delta=-0.1 must lie in \[0.0, 100.0\]"),
        ({"plateau_window": 2, "plateau_metric": "loss"}, r"plateau_metric='loss' is not one of"),
        ({"plateau_window": 10, "rounds": 15}, r"plateau_window=10 with rounds=15: .* at least 2 \* plateau_window"),
        ({"plateau_window": 3, "eval_every": 0}, r"plateau_window=3 with eval_every=0: .* in 1..plateau_window"),
        ({"plateau_window": 3, "eval_every": 4}, r"plateau_window=3 with eval_every=4"),
        ({"plateau_window": 3, "plateau_z": -1}, r"plateau_z=-1.0 must lie in \[0.0, 10.0\]"),
        (
            {"plateau_window": 10, "plateau_z": 1.645, "eval_every": 6},
            r"plateau_z=1.645 with plateau_window=10 and eval_every=6: .* 1..plateau_window // 2",
        ),
        ({"plateau_window": 3, "plateau_metric": "pm_accuracy"}, r"algorithm='fedavg': it has no personalized model"),
        (
            {"plateau_window": 3, "plateau_metric": "gm_accuracy", "algorithm": "fedrep"},
            r"plateau_metric='gm_accuracy' with algorithm='fedrep': its global model is not evaluated",
        ),
    ],
)
def test_wrong_plateau_settings_are_refused_naming_the_fields(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"rounds": 25, **fields})


def test_auto_watches_every_model_the_method_evaluates() -> None:
    """auto: the GM where it is evaluated, and the PM where the method has one (FedRep's GM is a shared body
    without a head, not evaluated); a named metric is watched alone."""
    from wafl.common.algorithms import registry
    from wafl.common.plateau import watched_metrics

    assert watched_metrics("auto", registry.resolve("fedavg")) == (GM,)
    assert watched_metrics("auto", registry.resolve("ditto")) == (GM, PM)
    assert watched_metrics("auto", registry.resolve("scd")) == (GM, PM)
    assert watched_metrics("auto", registry.resolve("fedrep")) == (PM,)
    assert watched_metrics("gm_accuracy", registry.resolve("ditto")) == (GM,)
    assert watched_metrics("pm_accuracy", registry.resolve("ditto")) == (PM,)


def _tiny(**fields) -> RunConfig:
    return load_config(None, {"num_clients": 3, "rounds": 8, "plateau_window": 2, **fields})


def test_a_run_in_process_ends_on_the_plateau_and_says_so(tmp_path: Path) -> None:
    """delta 100 points: the rule holds as soon as it is defined: round 2W for the GM, 2W + 1 for a PM (one
    round back). The run then ends as after its last round: every client reports on the final model."""
    rows = simulate(_tiny(plateau_delta=100.0), tmp_path / "gm")
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("stop_reason") for r in rows] == [None, None, None, PLATEAU]
    gm = [r["gm_accuracy"] for r in rows]
    assert rows[-1]["plateau_gap"] == pytest.approx(100 * ((gm[2] + gm[3]) / 2 - (gm[0] + gm[1]) / 2), abs=1e-5)
    finals = [json.loads(x) for x in (tmp_path / "gm" / "reports.jsonl").read_text().splitlines()]
    assert len([r for r in finals if r.get("final") == 1.0]) == 3
    assert ran_to_end(rows, 8)

    # Ditto: both models watched; the GM's rule is defined at round 4, the PM's (one round back) at round 5
    pm = simulate(_tiny(plateau_delta=100.0, algorithm="ditto", protocol="compute-and-wait"))
    assert [r["round"] for r in pm] == [1, 2, 3, 4, 5] and pm[-1]["stop_reason"] == PLATEAU
    p, g = [r["pm_accuracy"] for r in pm], [r["gm_accuracy"] for r in pm]
    assert pm[-1]["plateau_gap_pm"] == pytest.approx(100 * ((p[2] + p[3]) / 2 - (p[0] + p[1]) / 2), abs=1e-5)
    assert pm[-1]["plateau_gap_gm"] == pytest.approx(100 * ((g[3] + g[4]) / 2 - (g[1] + g[2]) / 2), abs=1e-5)
    assert "plateau_gap_pm" not in pm[3] and "plateau_gap_gm" in pm[3] and "stop_reason" not in pm[3]
    assert pm[-1]["pm_accuracy"] is not None  # the stopping round's PM, evaluated on the final model
    alone = simulate(_tiny(plateau_delta=100.0, algorithm="ditto", protocol="compute-and-wait", plateau_metric=PM))
    assert [r["round"] for r in alone] == [1, 2, 3, 4, 5] and "plateau_gap" in alone[-1]


def test_a_run_that_never_flattens_reaches_its_maximum_and_says_so() -> None:
    rows = simulate(_tiny(rounds=5, plateau_delta=0.0))
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    assert "plateau_gap" in rows[3] and "stop_reason" not in rows[3]
    assert rows[-1]["stop_reason"] == MAX_ROUNDS and not ran_to_end(rows[:-1], 5)


def test_a_sweep_point_records_why_it_stopped_and_the_table_shows_it(tmp_path: Path) -> None:
    from wafl.cli.experiments.sweep import DONE, run_point
    from wafl.cli.report.table import build, find_runs, markdown

    out = tmp_path / "sweep" / "seed=0"
    out.mkdir(parents=True)
    result = run_point(_tiny(plateau_delta=100.0).to_json(), str(out), network=False)
    assert result["ok"] and result["stop_reason"] == PLATEAU and result["rounds_run"] == 4
    assert json.loads((out / DONE).read_text())["stop_reason"] == PLATEAU
    doc = build(find_runs([tmp_path / "sweep"]))  # a point that stopped before `rounds` is a finished run
    assert doc["rows"]["fedavg"]["stopped"] == {"plateau": 1, "max_rounds": 0, "runs": 1, "plateau_rounds": [4]}
    assert "| fedavg | 1 | plateau 1/1 (round 4) |" in markdown(doc)


def test_wafl_run_over_grpc_ends_on_the_plateau(tmp_path: Path) -> None:
    from wafl.cli.launch.launcher import final_table, launch

    cfg = _tiny(rounds=6, plateau_delta=100.0)
    s = launch(cfg, tmp_path / "run", show_progress=False, timeout_s=300)
    assert s.ok, (tmp_path / "run" / "logs" / "server.log").read_text()[-2000:]
    assert [r["round"] for r in s.rows] == [1, 2, 3, 4] and s.rows[-1]["stop_reason"] == PLATEAU
    assert "4 of 6 (stopped: plateau)" in final_table(s, cfg)


def test_a_resumed_run_reads_the_watched_values_its_checkpoint_holds_back(tmp_path: Path) -> None:
    """--resume: the lines up to the checkpoint's round are read back (a line written after it is not), so
    the resumed run decides as the uninterrupted one would have; a PM watch also listens to new lines."""
    from wafl.common.algorithms import registry

    path = tmp_path / "results.jsonl"
    lines = [{"round": r, "gm_accuracy": 0.1 * r, "pm_accuracy": 0.05 * r if r % 2 else None} for r in range(1, 8)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    listeners: list = []
    gm = PlateauWatch.of(_tiny(), registry.resolve("fedavg"), listeners, path, resumed_through=5)
    assert gm is not None and gm.metrics == (GM,) and listeners == []
    assert gm.values(GM) == pytest.approx({r: 0.1 * r for r in range(1, 6)})
    pm = PlateauWatch.of(_tiny(algorithm="ditto"), registry.resolve("ditto"), listeners, path, resumed_through=5)
    assert pm is not None and pm.metrics == (GM, PM) and listeners == [pm.row]
    assert pm.values(PM) == pytest.approx({1: 0.05, 3: 0.15, 5: 0.25})
    assert pm.values(GM) == pytest.approx({r: 0.1 * r for r in range(1, 6)})
    assert PlateauWatch.of(_tiny(plateau_window=0), registry.resolve("fedavg"), [], path) is None


def test_the_final_model_of_a_run_stopped_on_the_plateau_is_the_stopping_rounds(tmp_path: Path) -> None:
    """The final model of a run that stopped after round s is version s + 1 (as version rounds + 1 ends a run that
    reaches its maximum): the clients' final reports and the new clients' adaptation of it name round s, so the
    stopping round's line gets its new-client accuracy."""
    rows = simulate(_tiny(num_clients=4, new_clients=1, plateau_delta=100.0), tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2, 3, 4] and rows[-1]["stop_reason"] == PLATEAU
    assert all(r["new_client_accuracy"] is not None for r in rows)
    reports = [json.loads(x) for x in (tmp_path / "run" / "reports.jsonl").read_text().splitlines()]
    assert {r["round"] for r in reports if r.get("final") == 1.0} == {4}

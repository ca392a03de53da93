"""The claim-family figure of ``benchmarks/real_data.py summary`` (``claims.png`` / ``claims.json``): the sweep
file's ``#   claims panel`` lines, the numbers drawn against a re-computation from the records, and the
plateau marked (a triangle and a dotted line where a seed stopped on it, a cross where it reached the maximum)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.real_data import claim_panels, claim_row, claims_data, claims_figure, plot_claims

SWEEP = """\
# a synthetic sweep: two methods, three seeds, the plateau rule over at most 30 rounds
#   wafl table runs/claims --by algorithm,params
#   claims panel "GM: FedProx against FedAvg" gm_accuracy FedProx:fedprox \\
#       "FedAvg:algorithm=fedavg"
#   claims panel "PM" pm_accuracy fedprox fedavg
out = "runs/claims"
[base]
num_clients = 3
rounds = 30
plateau_window = 5
[grid]
seed = [0, 1, 2]
algorithm = ["fedavg", "fedprox"]
"""

# seed -> (the round it stopped at, why): fedprox flattens on every seed, fedavg's seed 2 reaches the maximum
ENDS = {"fedprox": {0: (18, "plateau"), 1: (22, "plateau"), 2: (20, "plateau")},
        "fedavg": {0: (16, "plateau"), 1: (24, "plateau"), 2: (30, "max_rounds")}}  # fmt: skip


def _acc(algorithm: str, seed: int, t: int) -> float:
    return 0.9 - 0.5 * 0.8**t - (0.03 if algorithm == "fedavg" else 0.0) + 0.01 * seed


def _records(sweep: Path, ends: dict[str, dict[int, tuple[int, str | None]]] = ENDS) -> dict[str, Any]:
    from benchmarks.real_data import load_sweep_configs

    records = {}
    for name, config in load_sweep_configs(sweep):
        alg, seed = config["algorithm"], int(config["seed"])
        last, why = ends[alg][seed]
        rows = []
        for t in range(1, last + 1):
            row: dict[str, Any] = {"round": t, "wall_s": float(t), "gm_accuracy": _acc(alg, seed, t)}
            row["pm_accuracy"] = _acc(alg, seed, t - 1) + 0.1 if t > 1 else None  # a round late, as the PM's is
            if why is not None and t == last:
                row["stop_reason"] = why
            rows.append(row)
        records[name] = {"config": config, "rows": rows, "point": {"ok": True, "stop_reason": why}}
    return records


def test_claim_rows_and_panels_from_the_header(tmp_path: Path) -> None:
    assert claim_row("SCD:scd,params.lambda_p=0.4").__dict__ == {
        "name": "SCD",
        "spec": "SCD:scd,params.lambda_p=0.4",
        "where": ["algorithm=scd", "params.lambda_p=0.4"],
    }
    wf = claim_row("scd,protocol=wait-free")  # no name: the selector names the curve
    assert (wf.name, wf.where) == ("scd,protocol=wait-free", ["algorithm=scd", "protocol=wait-free"])
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    panels, columns = claim_panels(sweep)
    assert columns is None and [(p.title, p.metric) for p in panels] == [
        ("GM: FedProx against FedAvg", "gm_accuracy"),
        ("PM", "pm_accuracy"),
    ]
    assert [r.name for r in panels[0].rows] == ["FedProx", "FedAvg"]  # the continued line's row too
    assert [r.where for r in panels[1].rows] == [["algorithm=fedprox"], ["algorithm=fedavg"]]


def test_claims_numbers_and_plateau_markers(tmp_path: Path) -> None:
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    records = _records(sweep)
    by = ["algorithm", "params"]
    assert claims_figure(sweep, records, by, tmp_path)
    doc = json.loads((tmp_path / "claims.json").read_text())
    assert (tmp_path / "claims.png").stat().st_size > 10_000 and doc["unit"] == "%"
    gm, pm = doc["panels"]
    assert [r["name"] for r in gm["rows"]] == ["FedProx", "FedAvg"] and not gm["missing"]
    for panel in (gm, pm):
        metric = panel["metric"]
        for row in panel["rows"]:
            alg = row["spec"].split(":")[-1].removeprefix("algorithm=")
            # the mean, min and max over the seeds that reached each round, in %, recomputed from the rows
            for i, t in enumerate(row["round"]):
                vals = [100 * r[metric] for n, rec in records.items() if rec["config"]["algorithm"] == alg
                        for r in rec["rows"] if r["round"] == t and r[metric] is not None]  # fmt: skip
                assert row["mean"][i] == pytest.approx(sum(vals) / len(vals))
                assert (row["min"][i], row["max"][i], row["runs_per_round"][i]) == (
                    pytest.approx(min(vals)), pytest.approx(max(vals)), len(vals))  # fmt: skip
            # the table's final: each seed's mean over its last 10 evaluated rounds, then the mean over seeds
            finals = []
            for seed, (last, _) in ENDS[alg].items():
                ts = [t for t in range(1, last + 1) if metric == "gm_accuracy" or t > 1][-10:]
                finals.append(sum(100 * (_acc(alg, seed, t if metric == "gm_accuracy" else t - 1)
                                         + (0.1 if metric == "pm_accuracy" else 0)) for t in ts) / len(ts))  # fmt: skip
            assert row["mean_last"] == pytest.approx(sum(finals) / 3)
            assert [(s["seed"], s["round"], s["stop_reason"]) for s in row["stops"]] == [
                (seed, last, why) for seed, (last, why) in sorted(ENDS[alg].items())
            ]
        assert panel["window"] is None  # the seeds end on different rounds: no common window to shade
    drawn = plot_claims(doc["panels"], None, tmp_path / "again.png", "t")
    gm_drawn = drawn[0]
    assert gm_drawn["title"] == "GM: FedProx against FedAvg" and gm_drawn["shaded"] is None
    assert [c.split(":")[0] for c in gm_drawn["curves"]] == ["FedProx", "FedAvg"]
    assert "flat 3, max 0" in gm_drawn["curves"][0] and "flat 2, max 1" in gm_drawn["curves"][1]
    # a triangle at each seed's stop on the plateau (its last value), a dotted line at that round
    stops = sorted(
        (last, 100 * _acc(a, s, last)) for a in ENDS for s, (last, why) in ENDS[a].items() if why == "plateau"
    )
    assert sorted((x, pytest.approx(y)) for x, y in gm_drawn["plateau"]) == stops
    assert sorted(gm_drawn["dotted"]) == [x for x, _ in stops]
    assert gm_drawn["max_rounds"] == [[30.0, pytest.approx(100 * _acc("fedavg", 2, 30))]]


def test_claims_without_plateau_shade_the_common_last_rounds(tmp_path: Path) -> None:
    """Records of a fixed-round sweep (no stop_reason): no markers, the common last 10 rounds shaded."""
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    fixed = {a: {s: (15, None) for s in range(3)} for a in ENDS}
    records = _records(sweep, fixed)
    subplots = claims_data(*claim_panels(sweep), records, ["algorithm", "params"])
    assert [s["window"] for s in subplots] == [[6, 15], [6, 15]]
    drawn = plot_claims(subplots, None, tmp_path / "c.png", "t")
    for d in drawn:
        assert d["plateau"] == [] and d["max_rounds"] == [] and d["dotted"] == []
        assert d["shaded"] == [5.5, 15.5]


def test_claims_rows_must_pick_one_table_row_and_exist(tmp_path: Path) -> None:
    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    records = _records(sweep)
    panels, _ = claim_panels(sweep)
    with pytest.raises(SystemExit, match="picks 2 table rows"):
        claims_data([type(panels[0])("t", "gm_accuracy", [claim_row("seed=0")])], None, records, ["algorithm"])
    with pytest.raises(SystemExit, match="matches no point of the sweep"):
        claims_data([type(panels[0])("t", "gm_accuracy", [claim_row("moon")])], None, records, ["algorithm"])
    # a point of the sweep that has not finished yet: named as missing, not refused
    from benchmarks.real_data import load_sweep_configs

    configs = [c for _, c in load_sweep_configs(sweep)]
    some = {n: r for n, r in records.items() if r["config"]["algorithm"] == "fedavg"}
    (sub, _) = claims_data(panels, None, some, ["algorithm", "params"], configs)
    assert sub["missing"] == ["FedProx"] and [r["name"] for r in sub["rows"]] == ["FedAvg"]


def test_claim_pairs_and_the_verdicts_they_moved(tmp_path: Path) -> None:
    """``claims-pairs.json``'s numbers: each panel's subject minus its other row, seed by seed, in points, by
    the mean of the last 10 evaluated rounds and by the last round, against a slow re-computation from the
    rows; a shorter table's pair beside it with the seeds' verdict that changed flagged; a pair whose runs
    are missing has no numbers."""
    from benchmarks._claim_pairs import claim_pairs, markdown, moved

    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    records = _records(sweep)
    panels, columns = claim_panels(sweep)
    pairs = claim_pairs(panels, columns, records)
    assert [(p["panel"], p["subject"], p["other"]) for p in pairs] == [
        ("GM: FedProx against FedAvg", "FedProx", "FedAvg"),
        ("PM", "fedprox", "fedavg"),
    ]

    def slow(alg: str, seed: int, metric: str, last_only: bool) -> float:
        values = [r[metric] for r in records[f"algorithm={alg},seed={seed}"]["rows"] if r[metric] is not None]
        chosen = values[-1:] if last_only else values[-10:]
        return 100 * sum(chosen) / len(chosen)

    for p in pairs:
        metric = p["metric"]
        assert p["seeds"] == [0, 1, 2]
        for reading, last_only in (("mean_last", False), ("final", True)):
            want = [slow("fedprox", s, metric, last_only) - slow("fedavg", s, metric, last_only) for s in range(3)]
            assert list(p[f"{reading}_by_seed"].values()) == pytest.approx(want)
            assert p[reading]["mean"] == pytest.approx(sum(want) / 3) and p[reading]["n"] == 3
            assert p[reading]["seeds_verdict"] == (
                "better" if min(want) > 0 else "worse" if max(want) < 0 else "inconclusive"
            )
    # the shorter table: FedAvg above on every seed there, so the GM pair's seeds' verdict changed; the PM pair
    # has no runs there (its verdict cannot have moved)
    shorter = {n: {**r, "rows": [{**x, "gm_accuracy": x["gm_accuracy"] - (0.2 if "fedprox" in n else 0.0)}
                                 for x in r["rows"]]} for n, r in records.items()}  # fmt: skip
    before = [p for p in claim_pairs(panels, columns, shorter) if p["panel"] != "PM"]
    assert before[0]["final"]["seeds_verdict"] == "worse"
    both = moved(pairs, before)
    assert both[0]["changed"] and both[0]["before"] == before[0]["final"] and not both[1]["changed"]
    assert both[1]["before"] is None
    text = "\n".join(markdown(both, "short", "round 15"))
    assert "| GM: FedProx against FedAvg | FedProx − FedAvg | 3 |" in text and "| worse | **yes** |" in text
    assert both[0]["changed_by"] == [] and "at round" not in text  # without the plateau runs' earlier reading


def test_claim_pairs_read_at_the_shorter_tables_round_say_what_moved_a_verdict(tmp_path: Path) -> None:
    """The plateau runs read at round R (their last evaluated round up to R) against a slow re-computation; a
    seeds' verdict that changed is put down to the rounds when these runs already agreed with the shorter table
    at round R, to the runs when they did not (and then kept it)."""
    from benchmarks._claim_pairs import claim_pairs, markdown, moved

    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    records = _records(sweep)
    panels, columns = claim_panels(sweep)
    # FedProx below FedAvg until round 5 on every seed, above afterwards (as _acc has it)
    late = {n: {**r, "rows": [{**x, "gm_accuracy": x["gm_accuracy"] - (0.05 if "fedprox" in n and x["round"] <= 5
                                                                       else 0.0)}
                              for x in r["rows"]]} for n, r in records.items()}  # fmt: skip
    for r in late.values():  # round 5 not evaluated: the reading takes round 4
        r["rows"][4]["gm_accuracy"] = None
    pairs = claim_pairs(panels, columns, late, at_round=5)

    def slow(alg: str, seed: int) -> float:
        rows = late[f"algorithm={alg},seed={seed}"]["rows"]
        return 100 * [x["gm_accuracy"] for x in rows if x["round"] <= 5 and x["gm_accuracy"] is not None][-1]

    gm, pm = pairs
    want = [slow("fedprox", s) - slow("fedavg", s) for s in range(3)]
    assert list(gm["at_round_by_seed"].values()) == pytest.approx(want) and max(want) < 0
    assert gm["round"] == 5 and gm["at_round"]["seeds_verdict"] == "worse"
    assert gm["mean_last"]["seeds_verdict"] == "better"
    # the shorter table ended at round 5 with the same order: the rounds moved the verdict
    shorter = {n: {**r, "rows": r["rows"][:5]} for n, r in late.items()}
    both = moved(pairs, claim_pairs(panels, columns, shorter))
    assert both[0]["changed"] and both[0]["changed_by"] == ["rounds"]
    text = "\n".join(markdown(both, "short", "round 5"))
    assert "these runs at round 5" in text and "| worse | **yes**: the rounds |" in text
    # a shorter table whose runs already had FedProx above at round 5: the runs moved it, the rounds did not
    other = moved(pairs, claim_pairs(panels, columns, {n: {**r, "rows": r["rows"][:5]} for n, r in records.items()}))
    assert other[0]["before"]["seeds_verdict"] == "better" and not other[0]["changed"]
    assert other[0]["changed_by"] == ["runs", "rounds"]  # both steps moved it, and back
    # the PM at round 5: read on the seeds both evaluated by then
    assert pm["at_round"]["n"] == 3
    # a shorter table of two seeds, whose seed 1 had FedProx above at round 5 and seed 0 below: inconclusive there;
    # these runs on those seeds are below on both (the runs), and the plateau is above (the rounds)
    two = {}
    for n in late:
        if "seed=2" not in n:
            source = late if "seed=0" in n else records
            two[n] = {**source[n], "rows": source[n]["rows"][:5]}
    (gm_two, _) = moved(pairs, claim_pairs(panels, columns, two))
    assert gm_two["before_seeds"] == [0, 1] and gm_two["before"]["seeds_verdict"] == "inconclusive"
    assert gm_two["at_round_same_seeds"]["n"] == 2 and gm_two["changed_by"] == ["runs", "rounds"]
    # the same seeds' verdict, but the third seed makes these runs' round 5 inconclusive: the added seeds
    third = copy.deepcopy(late)
    for x in third["algorithm=fedprox,seed=2"]["rows"][:4]:
        x["gm_accuracy"] += 0.2
    shorter2 = {n: {**r, "rows": r["rows"][:5]} for n, r in late.items() if "seed=2" not in n}
    (gm_third, _) = moved(claim_pairs(panels, columns, third, at_round=5), claim_pairs(panels, columns, shorter2))
    assert gm_third["before"]["seeds_verdict"] == "worse"
    assert gm_third["at_round_same_seeds"]["seeds_verdict"] == "worse"
    assert gm_third["at_round"]["seeds_verdict"] == "inconclusive" and gm_third["changed_by"] == ["seeds", "rounds"]
    assert "**yes**: the added seeds and the rounds" in "\n".join(markdown([gm_third], "short", "round 5"))
    # a row without finished runs: the pair is listed, without numbers
    fewer = {n: r for n, r in records.items() if "fedavg" not in n}
    (lonely, _) = claim_pairs(panels, columns, fewer)
    assert lonely["seeds"] == [] and lonely["mean_last"] is None
    assert "| not yet run | - |" in "\n".join(markdown([lonely], None, None))


def test_claims_pair_lines_add_pairs_that_are_not_drawn(tmp_path: Path) -> None:
    """A header's ``claims pair`` line adds its comparison to ``claims-pairs.json`` and table.md's section, after
    the panels' pairs, and draws nothing (``claim_panels`` reads only the panels)."""
    from benchmarks.real_data import CLAIM_PAIRS_JSON, claims_pairs_section

    sweep = tmp_path / "s.toml"
    sweep.write_text(
        SWEEP.replace(
            'out = "runs/claims"', '#   claims pair "PM, undrawn" pm_accuracy fedavg fedprox\nout = "runs/claims"'
        )
    )
    panels, _ = claim_panels(sweep)
    (extra,), _ = claim_panels(sweep, "claims pair")
    assert len(panels) == 2 and (extra.title, extra.metric, [r.name for r in extra.rows]) == (
        "PM, undrawn",
        "pm_accuracy",
        ["fedavg", "fedprox"],
    )
    text = "\n".join(claims_pairs_section(sweep, _records(sweep), tmp_path))
    doc = json.loads((tmp_path / CLAIM_PAIRS_JSON).read_text())
    assert [(p["panel"], p["subject"], p["other"]) for p in doc["pairs"]] == [
        ("GM: FedProx against FedAvg", "FedProx", "FedAvg"),
        ("PM", "fedprox", "fedavg"),
        ("PM, undrawn", "fedavg", "fedprox"),
    ]
    undrawn, drawn = doc["pairs"][2], doc["pairs"][1]
    assert undrawn["mean_last"]["mean"] == pytest.approx(-drawn["mean_last"]["mean"])  # the same pair, reversed
    assert "| PM, undrawn | fedavg − fedprox | 3 |" in text and doc["before"] is None


def test_the_plateau_note_names_points_that_stopped_under_the_earlier_rule() -> None:
    """A point with both models whose lines name one plateau_gap watched the PM alone (the rule before it
    watched both); a point watched on both, a GM-only one and one that named its metric are not listed."""
    from benchmarks.real_data import earlier_rule, plateau_note

    cfg = {"plateau_window": 2, "plateau_delta": 0.5, "rounds": 10, "plateau_metric": "auto"}

    def rec(rows: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
        return {"config": {**cfg, **config}, "rows": rows}

    both = [{"round": 1, "gm_accuracy": 0.5, "pm_accuracy": 0.8}]
    records = {
        "old": rec([*both, {"round": 4, "gm_accuracy": 0.6, "pm_accuracy": 0.8, "plateau_gap": 0.1}]),
        "new": rec([*both, {"round": 4, "gm_accuracy": 0.6, "pm_accuracy": 0.8, "plateau_gap_gm": 0.1}]),
        "gm": rec([{"round": 4, "gm_accuracy": 0.6, "pm_accuracy": None, "plateau_gap": 0.1}]),
        "named": rec([*both, {"round": 4, "gm_accuracy": 0.6, "plateau_gap": 0.1}], plateau_metric="pm_accuracy"),
    }
    assert earlier_rule(records) == ["old"]
    text = "\n".join(plateau_note(cfg, records))
    assert "1 point(s) of methods with both models" in text and "`old`" in text and "`new`" not in text
    assert "earlier" not in "\n".join(plateau_note(cfg, {k: v for k, v in records.items() if k != "old"}))
    assert plateau_note({**cfg, "plateau_window": 0}, records) == []


def test_claim_pairs_at_equal_rounds_read_both_runs_up_to_the_earlier_stop(tmp_path: Path) -> None:
    """equal_rounds: on each seed both runs by the mean of their last 10 evaluated rounds up to the earlier of
    their two last rounds, against a slow re-computation; it equals mean_last on a seed whose runs stopped at
    the same round, and table.md shows it only where asked (a plateau table)."""
    from benchmarks._claim_pairs import claim_pairs, markdown

    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP)
    ends = {**ENDS, "fedavg": {0: (18, "plateau"), 1: (24, "plateau"), 2: (30, "max_rounds")}}
    records = _records(sweep, ends)
    panels, columns = claim_panels(sweep)
    plain = claim_pairs(panels, columns, records)
    assert all("equal_rounds" not in p for p in plain) and "equal rounds" not in "\n".join(markdown(plain, None, None))
    pairs = claim_pairs(panels, columns, records, equal_rounds=True)

    def slow(alg: str, seed: int, metric: str, upto: int) -> float:
        rows = records[f"algorithm={alg},seed={seed}"]["rows"]
        values = [r[metric] for r in rows if r[metric] is not None and r["round"] <= upto][-10:]
        return 100 * sum(values) / len(values)

    for p in pairs:
        upto = {s: min(ENDS["fedprox"][s][0], ends["fedavg"][s][0]) for s in range(3)}
        assert p["equal_rounds_round"] == {"0": 18, "1": 22, "2": 20} == {str(s): r for s, r in upto.items()}
        want = [slow("fedprox", s, p["metric"], upto[s]) - slow("fedavg", s, p["metric"], upto[s]) for s in range(3)]
        assert list(p["equal_rounds_by_seed"].values()) == pytest.approx(want)
        assert p["equal_rounds"]["mean"] == pytest.approx(sum(want) / 3)
        assert p["equal_rounds_by_seed"]["0"] == pytest.approx(p["mean_last_by_seed"]["0"])  # both stopped at 18
        assert p["equal_rounds_by_seed"]["1"] != pytest.approx(p["mean_last_by_seed"]["1"])
    text = "\n".join(markdown(pairs, None, None))
    assert "| at equal rounds | its seeds' rule |" in text and "At equal rounds: on each seed" in text

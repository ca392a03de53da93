"""Every script in ``benchmarks/`` runs in its smoke mode (``--smoke``: tiny sizes) and records what it
measured with the commit it measured: a benchmark that no longer runs on today's code fails here."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# scripts whose smoke run is tested in a file of its own (with checks of their own)
ELSEWHERE = {
    "chaos": "test_chaos.py",
    "gpu_check": "test_gpu_scripts.py",
    "gpu_fleet": "test_gpu_scripts.py",
    "pm_floor": "test_pm_floor_bench.py",
}


def _commit(doc: dict[str, Any]) -> None:
    assert re.fullmatch(r"[0-9a-f]{40}", doc["commit"] or ""), doc.get("commit")


def _main_job(d: dict[str, Any]) -> None:
    (r,) = d["runs"]
    assert r["ok"] and r["rounds"] == 2 and r["gm_accuracy"] > 0.1, r
    assert r["peak_pss_gb"] > 0 and r["peak_rss_gb"] >= r["peak_pss_gb"] and r["peak_processes"] >= 3  # launcher+
    assert len(r["loadavg_before"]) == 3 and r["cpu_s"] > 0 and r["cpu_s_by_role"]["worker"] > 0


def _transport(d: dict[str, Any]) -> None:
    assert d["single_client"]["all_bytes_acknowledged"] and d["concurrent"]["all_bytes_acknowledged"]
    assert d["single_client"]["median_MBps"] > 0 and d["noop_round"]["server_round_s"] > 0
    assert min(d["grpc_alone"]["plain"]["MBps"]) > 0 and d["raw_tcp"]
    (upload, *_) = d["diagnostics"]["server-stage-times"]["uploads"]
    assert {"UploadFold.add (executor thread)", "TransferChecker.check (event loop)"} <= set(upload["stages"])
    assert set(d["checks"]) and all("pass" in c for c in d["checks"].values())


def _sim_overhead(d: dict[str, Any]) -> None:
    assert [(p["algorithm"], p["clients"], p["rounds"]) for p in d["points"]] == [
        ("fedavg", 3, 2),
        ("scd", 3, 2),
        ("fedhkd", 3, 2),
    ]
    assert (d["slots"], d["eval_every"]) == ("processes", 0)  # the defaults: training processes, a final evaluation
    for p in d["points"]:
        assert p["slots"] == "processes"
        assert p["simulation_s"] > 0 and p["training_alone_s"] > 0 and p["training_steps"] > 0
        assert p["training_alone_threads_s"] > 0 and p["ratio_to_threads"] > 0 and p["training_alone_by_client_s"] > 0
        assert p["ratio"] == pytest.approx(p["simulation_s"] / p["training_alone_s"], rel=0.01)
        assert p["gm_accuracy"] > 0.1
        # the slot-call floor trains the same steps through the same process slots, and its CPU is measured
        floor = p["slot_calls_alone"]
        assert floor["steps"] == p["training_steps"] and floor["processes"] == 2
        assert floor["cpu_s"]["slot_processes"] > 0 and p["simulation_cpu_s"]["slot_processes"] > 0
        assert p["training_alone_cpu_s"] > 0 and p["simulation_cpu_s"]["event_loop_process"] > 0
        assert p["ratio_to_slot_calls"] == pytest.approx(p["simulation_s"] / floor["wall_s"], rel=0.01)


def _train_step(d: dict[str, Any]) -> None:
    assert {(r["model"], r["kind"]) for r in d["results"]} == {("cnn", k) for k in ("gm", "pm_scd", "pm_ditto")}
    assert all(r["samples_per_s"] > 0 for r in d["results"])


def _fleet(d: dict[str, Any]) -> None:
    (r,) = d["runs"]
    assert r["ok"] and r["clients"] == 4 and r["mode"] == "workers"


def _norm_bound_honest(d: dict[str, Any]) -> None:
    (pt,) = d["points"]
    assert pt["identical"] and set(pt["runs"]) == {"10.0", "0.0"}, pt
    assert all(len(r["gm_accuracy"]) == 2 and r["gm_accuracy"][-1] > 0.1 for r in pt["runs"].values())


def _scale(d: dict[str, Any]) -> None:
    (f,) = d["fleets"]
    assert f["clients"] == 30 and f["real"]["ok"] and f["bare"]["ok"] and f["cost_ratio"] > 0


def _real_data(d: dict[str, Any]) -> None:
    assert d["first_rc"] == 0 and d["kept"] == 2 and d["restored"] == 2, d
    assert d["second_rc"] == 0 and "0 to run, 2 already done" in d["second_run"], d["second_run"]  # nothing re-run
    fields = ["config", "point", "rows"]  # the records only: no logs, no reports
    assert d["kept_points"] == {f"algorithm={a}": fields for a in ("fedavg", "fedprox")}
    assert len(d["round_trip_same_bytes"]) == 6 and all(d["round_trip_same_bytes"].values()), d["round_trip_same_bytes"]
    assert d["broken_restored"] == 1 and d["broken_point_left_out"]  # a record without rows runs again
    assert d["verified"] == {"algorithm=fedavg": []}  # run again from the sweep file: the kept numbers
    (caught,) = d["tampered_caught"]["algorithm=fedavg"]  # a kept accuracy off in its 4th decimal is named
    assert caught.startswith("round 2: gm_accuracy "), caught
    # --rounds 1: the point run to round 2 (the plateau rule's two windows of 1), its first round compared
    assert d["first_round_verified"] == {"algorithm=fedavg": []} and d["first_round_run_rows"] == 2
    assert set(d["table"]["rows"]) == {"fedavg", "fedprox mu=0.01"} and set(d["table"]["differences"]) == {
        "fedprox mu=0.01"
    }
    assert "Points done: 2 of 2." in d["table_md"] and d["curves_png_bytes"] > 0
    assert d["table"]["rows"]["fedavg"]["final_gm"]["mean"] > 0.2  # above chance on 10 classes
    # the smoke sweep's points stop on the plateau after round 2 of 3 (delta 100 points): said in the table
    assert d["table"]["rows"]["fedavg"]["stopped"] == {"plateau": 1, "max_rounds": 0, "runs": 1, "plateau_rounds": [2]}
    assert "| plateau 1/1 (round 2) |" in d["table_md"] and "Each point stopped once" in d["table_md"]
    # the header's curves command (two comment lines) ran on the unpacked records, its files beside them
    groups = d["figure"]["groups"]
    assert set(groups) == {"fedavg", "fedprox mu=0.01"} and d["figure"]["metrics"] == ["train_loss"]
    assert all(g["train_loss"]["round"] == [1, 2] and "/work/algorithm=" in g["runs"][0] for g in groups.values())
    assert "--json" in d["table_md"] and "/kept/loss.json" in d["table_md"]
    # the header's claims panel: claims.png / claims.json beside the records, each seed's stop on the plateau
    (panel,) = d["claims"]["panels"]
    assert panel["title"] == "GM: FedProx against FedAvg" and [r["name"] for r in panel["rows"]] == [
        "FedProx",
        "FedAvg",
    ]
    assert all(r["stops"] == [{**r["stops"][0], "stop_reason": "plateau", "round": 2}] for r in panel["rows"])
    assert d["claims_png_bytes"] > 0 and "`claims.png`, `claims.json`" in d["table_md"]
    # the panel's pair: FedProx minus FedAvg on the one seed, judged inconclusive (one seed), in table.md too
    (pair,) = d["claims_pairs"]["pairs"]
    assert (pair["subject"], pair["other"], pair["seeds"]) == ("FedProx", "FedAvg", [0]) and d["claims_pairs"][
        "before"
    ] is None
    assert (
        pair["mean_last"]["seeds_verdict"] == "inconclusive"
        and "| GM: FedProx against FedAvg | FedProx − FedAvg | 1 |" in d["table_md"]
    )


def _waitfree_crossover(d: dict[str, Any]) -> None:
    import math

    assert not d["failed"] and len(d["points"]) == 2 and d["figure_bytes"] > 0, d["failed"]
    assert {pt["rate"] for pt in d["points"]} == {"50mbit", "200mbit"} and d["settings"] == ["rounds=2"]
    for pt in d["points"]:
        assert pt["ok"] and pt["x"] > 0 and pt["p"] > 0, pt
        assert pt["x"] == round(pt["t_comm_s"] / pt["t_gm_s"], 4)
        assert set(pt["pm_share"]["wait-free"]) == {"client-0", "client-1"}
        assert set(pt["pm_share"]) == set(pt["zeta_s"]) == {"compute-and-wait", "wait-free", "adaptive"}
        assert all(0 <= v <= 1 for proto in pt["pm_share"].values() for v in proto.values())
        assert "adaptive_vs_best" in pt and "adaptive_vs_cw" in pt and 0 <= pt["adaptive_pre_upload"] <= 1
    assert d["protocols"] == ["compute-and-wait", "wait-free", "adaptive"] and d["adaptive_target"] == 1.05
    s = d["summary"]["ditto"]
    assert s["adaptive_points"] == 2
    p = s["p_median"]
    # p_median is rounded to 4 digits and the crossover computed from the unrounded median: equal to 1e-4
    assert s["points"] == 2 and abs(s["predicted_crossover_x"] - (math.sqrt(1 + 4 * p) - 1) / 2) <= 1.5e-4


# script path -> (arguments after --smoke given the test's folder, the JSON it writes there, its checks)
SMOKE: dict[str, tuple[Callable[[Path], list[str]], str, Callable[[dict[str, Any]], None]]] = {
    "benchmarks/main_job.py": (lambda t: ["--out", str(t / "r.json")], "r.json", _main_job),
    "benchmarks/transport.py": (lambda t: ["--out", str(t / "r.json")], "r.json", _transport),
    "benchmarks/sim_overhead.py": (lambda t: ["--out", str(t / "r.json")], "r.json", _sim_overhead),
    "benchmarks/train_step.py": (lambda t: ["--out", str(t / "r.json")], "r.json", _train_step),
    "benchmarks/fleet.py": (lambda t: ["--out", str(t), "--runs", str(t / "runs")], "fleet.json", _fleet),
    "benchmarks/scale.py": (lambda t: ["--results", str(t)], "scale.json", _scale),
    "benchmarks/norm_bound_honest.py": (lambda t: ["--out", str(t / "r.json")], "r.json", _norm_bound_honest),
    "benchmarks/real_data.py": (lambda t: ["--out", str(t)], "smoke.json", _real_data),
    "benchmarks/waitfree_crossover.py": (lambda t: ["--out", str(t)], "crossover.json", _waitfree_crossover),
}


def test_every_benchmark_script_has_a_smoke_test() -> None:
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")}
    assert scripts == {Path(s).stem for s in SMOKE} | set(ELSEWHERE)
    for name, test_file in ELSEWHERE.items():
        text = (REPO / "tests" / test_file).read_text()
        assert f"benchmarks/{name}.py" in text and "--smoke" in text, (name, test_file)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the transport smoke run starts six servers and a dozen clients
@pytest.mark.parametrize("name", sorted(SMOKE))
def test_benchmark_smoke_run(name: str, tmp_path: Path) -> None:
    args, saved, check = SMOKE[name]
    p = subprocess.run(
        [sys.executable, name, "--smoke", *args(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / saved).read_text())
    _commit(doc)
    check(doc)


@pytest.mark.slow
def test_sim_overhead_runs_a_sweep_files_setting(tmp_path: Path) -> None:
    """``--base`` takes the points' settings from a sweep file's [base] (here the Fashion-MNIST SCD
    table's: LeNet-5, Dirichlet 0.1), the point's own algorithm, clients and rounds over them; a
    missing file is a usage error that names it."""
    script = "benchmarks/sim_overhead.py"
    base = ["--base", "configs/sweeps/scd_fmnist.toml"]
    args = [sys.executable, script, "--smoke", *base, "--rounds", "1", "--algorithms", "fedavg", "--slots", "threads"]
    p = subprocess.run([*args, "--out", str(tmp_path / "r.json")], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["base"] == "configs/sweeps/scd_fmnist.toml"
    assert (doc["base_settings"]["dataset"], doc["base_settings"]["model"]) == ("fashion-mnist", "lenet5")
    (pt,) = doc["points"]
    assert (pt["algorithm"], pt["clients"], pt["rounds"], pt["slots"]) == ("fedavg", 3, 1, "threads")
    # three clients share Fashion-MNIST's training images: an epoch is a thousand-odd steps of 32, not digits' dozens
    assert pt["training_steps"] > 1000 and pt["gm_accuracy"] > 0.1
    bad = subprocess.run(
        [sys.executable, script, "--smoke", "--base", "missing.toml"], cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--base 'missing.toml' does not exist" in bad.stderr, bad.stderr
    bad = subprocess.run(
        [sys.executable, script, "--smoke", "--eval-every", "-1"], cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--eval-every must be at least 0" in bad.stderr, bad.stderr


def test_sim_overhead_replays_the_same_training_in_either_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The training-alone replay, round by round (the ratio's baseline) or client by client, trains every
    client on the broadcasts it received in the same per-client order: the same steps, the same models."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from sim_overhead import Recorder, _replay, workload
    from wafl.cli.sim.simulate import simulate
    from wafl.client.compute import SharedSlots
    from wafl.client.trainer import Trainer
    from wafl.common.datasets import load_dataset

    cfg = workload("fedavg", 3, 2)
    with Recorder() as rec:  # it records what the training slots are handed
        simulate(cfg, pool=lambda: SharedSlots(2))
    assert sorted(rec.received) == [0, 1, 2] and all(len(v) == 2 for v in rec.received.values())
    data = load_dataset(cfg.data.dataset)
    models = []
    for by_client in (False, True):
        part = [Trainer(cfg, i, dataset=data, device="cpu") for i in range(3)]
        steps = _replay(cfg, part, rec.received, by_client)
        models.append((steps, [t.gm.state_dict() for t in part]))
    (steps_a, a), (steps_b, b) = models
    assert steps_a == steps_b > 0
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_kept_real_data_records_are_complete_and_tracked() -> None:
    """Every kept point of the Fashion-MNIST sweeps (one records.json a sweep) holds its configuration, its
    rows and a finished point.json, and git tracks the file (an ignore rule that drops it would lose it on
    the next fresh clone, and with it the tables' source); no per-point run files are committed."""
    from benchmarks.real_data import incomplete, read_records

    real_data_dir = REPO / "benchmarks" / "results" / "real-data"
    files = sorted(real_data_dir.glob("*/records.json"))
    for f in files:
        recs = read_records(f)
        bad = {n: incomplete(r) for n, r in recs.items() if incomplete(r) or not r["point"].get("ok")}
        assert recs and not bad, (str(f), bad)
        # every round's row, up to the maximum or to the round a point stopped on the plateau
        for name, r in recs.items():
            ran = r["point"].get("rounds_run", r["config"]["rounds"]) if r["point"].get("stop_reason") else None
            assert len(r["rows"]) == (ran or r["config"]["rounds"]), (str(f), name)
    probe = [str(f.relative_to(REPO)) for f in files] or ["benchmarks/results/real-data/any/records.json"]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *probe], cwd=REPO, capture_output=True, text=True)
    assert ignored.returncode == 1 and not ignored.stdout, ignored.stdout
    listed = subprocess.run(["git", "ls-files", str(real_data_dir)], cwd=REPO, capture_output=True, text=True)
    run_files = ("results.jsonl", "config.json", "point.json")
    per_point = [t for t in listed.stdout.splitlines() if Path(t).name in run_files]
    assert not per_point, per_point[:5]


def test_prefix_rounds_keep_the_compared_rounds_evaluations() -> None:
    """``verify --rounds N``: the shorter run evaluates the first N rounds as the point did. A run evaluates its
    last round, and under the plateau rule its last ``2 * plateau_window``: one round past N, or two windows
    past it where the point evaluates every few rounds; never fewer than the rule's two windows; the whole
    point where that is no shorter."""
    from wafl.common.config import RunConfig

    from benchmarks.real_data import prefix_rounds

    assert prefix_rounds({"rounds": 300, "plateau_window": 20, "eval_every": 1}, 40) == 41
    assert prefix_rounds({"rounds": 300, "plateau_window": 20, "eval_every": 1}, 10) == 40
    assert prefix_rounds({"rounds": 1000, "plateau_window": 100, "eval_every": 5}, 50) == 250
    assert prefix_rounds({"rounds": 35, "eval_every": 5}, 10) == 11
    assert prefix_rounds({"rounds": 300, "plateau_window": 20, "eval_every": 1}, 299) is None
    assert prefix_rounds({"rounds": 15}, 20) is None
    with pytest.raises(ValueError, match="at least 1"):
        prefix_rounds({"rounds": 15}, 0)
    # the slow re-computation: the point's and the shorter run's schedules agree on every compared round
    for rounds, window, every, first in [(1000, 100, 5, 50), (300, 20, 1, 40), (300, 20, 2, 7), (35, 0, 5, 10)]:
        flat = {"rounds": rounds, "plateau_window": window, "eval_every": every}
        point = RunConfig.from_json(json.dumps({**json.loads(RunConfig().to_json()), **flat})).validate()
        n = prefix_rounds(flat, first)
        assert n is not None
        short = RunConfig.from_json(json.dumps({**json.loads(point.to_json()), "rounds": n})).validate()
        assert [short.evaluates(r) for r in range(1, first + 1)] == [point.evaluates(r) for r in range(1, first + 1)]


def test_a_table_without_its_baseline_drops_the_pairing_too() -> None:
    """While a sweep's baseline has no finished point, its table runs without ``--baseline`` and without
    ``--within`` (which needs one), every other argument kept in order."""
    from benchmarks.real_data import without_baseline

    args = ["--by", "algorithm,params,num_clients", "--within", "num_clients", "--baseline", "fedavg", "--target", "1"]
    assert without_baseline(args) == ["--by", "algorithm,params,num_clients", "--target", "1"]
    assert without_baseline(["--baseline", "fedavg num_clients=10"]) == []


def test_rerun_drops_the_matching_points_records_and_folders(tmp_path: Path) -> None:
    """``real_data.py run --rerun GLOB``: the matching points' kept records and finished folders are
    dropped (so the sweep runs them again), the others kept; a pattern matching no point is an error."""
    from benchmarks.real_data import drop, read_records, write_records

    sweep = tmp_path / "s.toml"
    sweep.write_text(
        'out = "o"\n[base]\nrounds = 1\n[grid]\nseed = [0, 1]\n'
        '[[points]]\nalgorithm = "fedavg"\n[[points]]\nalgorithm = "pfedme"\n'
    )
    names = ["algorithm=fedavg,seed=0", "algorithm=fedavg,seed=1", "algorithm=pfedme,seed=0", "algorithm=pfedme,seed=1"]
    kept, out = tmp_path / "records.json", tmp_path / "out"
    write_records(kept, {n: {"config": {"n": n}, "rows": [{}], "point": {"ok": True}} for n in names})
    for n in names:
        (out / n).mkdir(parents=True)
        (out / n / "point.json").write_text("{}")
    assert drop(sweep, out, kept, ["algorithm=pfedme,*"]) == names[2:]
    assert sorted(read_records(kept)) == names[:2]
    assert sorted(p.name for p in out.iterdir()) == names[:2]
    with pytest.raises(SystemExit, match="matches no point"):
        drop(sweep, out, kept, ["algorithm=fedrep,*"])


def test_restore_leaves_out_points_of_the_earlier_plateau_rule_and_save_replaces_them(tmp_path: Path) -> None:
    """A kept point with both models that stopped when ``auto`` watched its PM alone (one ``plateau_gap``) is
    not restored, so the sweep runs it again; ``save`` then replaces its record with the new run's, which
    ``restore`` takes back. A GM-only point of the same rule is restored as it is."""
    from benchmarks.real_data import read_records, restore, save, write_records

    sweep = tmp_path / "s.toml"
    sweep.write_text(
        'out = "o"\n[base]\nrounds = 1\n[[points]]\nalgorithm = "fedavg"\n[[points]]\nalgorithm = "ditto"\n'
    )
    cfg = {"plateau_window": 2, "plateau_metric": "auto", "rounds": 9}
    old = [{"round": 4, "gm_accuracy": 0.5, "pm_accuracy": 0.8, "plateau_gap": 0.1, "stop_reason": "plateau"}]
    gm = [{"round": 4, "gm_accuracy": 0.5, "plateau_gap": 0.1, "stop_reason": "plateau"}]
    kept, out = tmp_path / "records.json", tmp_path / "out"
    write_records(
        kept,
        {
            "algorithm=ditto": {"config": cfg, "rows": old, "point": {"ok": True}},
            "algorithm=fedavg": {"config": cfg, "rows": gm, "point": {"ok": True}},
        },
    )
    assert restore(kept, out) == 1 and sorted(p.name for p in out.iterdir()) == ["algorithm=fedavg"]
    new = [{"round": 4, "gm_accuracy": 0.5, "pm_accuracy": 0.8, "plateau_gap_gm": 0.1, "plateau_gap_pm": 0.2}]
    (out / "algorithm=ditto").mkdir()
    (out / "algorithm=ditto" / "config.json").write_text(json.dumps(cfg))
    (out / "algorithm=ditto" / "results.jsonl").write_text(json.dumps(new[0]) + "\n")
    (out / "algorithm=ditto" / "point.json").write_text('{"ok": true}\n')
    assert save(sweep, out, kept) == 2 and read_records(kept)["algorithm=ditto"]["rows"] == new
    assert restore(kept, tmp_path / "again") == 2


def test_restore_leaves_out_points_of_another_configuration_and_the_table_names_them(tmp_path: Path, capsys) -> None:
    """A kept point that ran before its sweep file (or a default) changed is not restored, so the sweep runs it
    again; a point of the current configuration is; summary's table names the changed ones until replaced."""
    from benchmarks.real_data import (
        changed_note,
        changed_points,
        load_sweep_configs,
        restore,
        summary,
        write_records,
    )

    sweep = tmp_path / "s.toml"
    sweep.write_text('out = "o"\n[base]\nrounds = 1\ngrad_clip = 10.0\n[grid]\nalgorithm = ["fedavg", "fedprox"]\n')
    now = dict(load_sweep_configs(sweep))
    row = [{"round": 1, "gm_accuracy": 0.5}]
    before = {k: v for k, v in now["algorithm=fedprox"].items() if k != "grad_clip"}  # written before the field
    records = {
        "algorithm=fedavg": {"config": now["algorithm=fedavg"], "rows": row, "point": {"ok": True}},
        "algorithm=fedprox": {"config": before, "rows": row, "point": {"ok": True}},
    }
    kept = tmp_path / "records.json"
    write_records(kept, records)
    assert restore(kept, tmp_path / "all") == 2  # without the sweep file: every complete record
    assert restore(kept, tmp_path / "out", sweep) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["algorithm=fedavg"]
    assert "algorithm=fedprox in" in capsys.readouterr().err
    changed = changed_points(sweep, records)
    assert changed == {"algorithm=fedprox": ["grad_clip: 0.0 -> 10.0"]}
    note = changed_note(changed)[0]
    assert note.startswith("1 kept point(s) ran with another configuration") and "`grad_clip`" in note
    only_changed = tmp_path / "changed.json"
    write_records(only_changed, {"algorithm=fedprox": records["algorithm=fedprox"]})
    with pytest.raises(SystemExit, match=r"1 kept point\(s\) ran with another configuration .*fedprox: grad_clip"):
        summary(sweep, only_changed, tmp_path / "work")  # says why nothing is left, not just that nothing is


def test_sweep_file_figure_commands_run_on_their_sweeps_records() -> None:
    """Every ``#   wafl analyze curves`` command in a sweep file's header reads that sweep's folder and
    writes files that ``real_data.py summary`` can put beside the records under their own names; the
    Fashion-MNIST analysis sweeps have theirs (the new-client, G_d and sensitivity figures)."""
    from wafl.common.config import ConfigError

    from benchmarks.real_data import figure_args, header_commands, load_out

    found = {}
    for f in sorted((REPO / "configs" / "sweeps").glob("*.toml")):
        try:
            out = str(load_out(f))
        except ConfigError:  # a sweep of a dataset this checkout lacks: its file is tested elsewhere
            continue
        for args in header_commands(f):
            positional = [
                a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or not args[i - 1].startswith("--"))
            ]
            assert positional == [out], (f.name, args)
            assert "--out" in args, (f.name, args)
            moved = figure_args(args, out, "W", REPO / "H")
            assert moved[0] == "W" and all(
                Path(moved[i + 1]).parent == Path("H") for i, a in enumerate(moved[:-1]) if a in ("--out", "--json")
            ), moved
            found.setdefault(f.stem, []).append(args[args.index("--out") + 1])
    assert found["scd_fmnist_new_clients"] == ["new_clients.png"]
    assert found["asd_fmnist_dissimilarity"] == ["gd_rounds.png", "gd_lambda.png"]
    assert found["scd_fmnist_sensitivity"] == ["tau.png", "lambda_p.png", "lambda_g.png"]


def test_crossover_counts_a_point_wait_free_did_not_finish_and_draws_it(tmp_path: Path) -> None:
    """A point where only compute-and-wait reached the PM target within the rounds has no time-to-target
    ratio; it is counted as wait-free's miss and drawn (above the measured ratios), not silently dropped."""
    from benchmarks.waitfree_crossover import plot, summarize, wait_free_missed

    def pt(rate: str, x: float, wf: float | None, cw: float | None) -> dict[str, Any]:
        ratio = round(wf / cw, 4) if wf and cw else None
        return {"algorithm": "scd", "rate": rate, "x": x, "p": 0.5, "zeta_s": {"wait-free": wf, "compute-and-wait": cw},
                "zeta_ratio": ratio}  # fmt: skip

    points = [pt("2mbit", 3.0, 20.0, 70.0), pt("100mbit", 0.1, None, 26.0), pt("1gbit", 0.01, None, None)]
    assert [p["rate"] for p in wait_free_missed(points, "scd")] == ["100mbit"]
    s = summarize(points)["scd"]
    assert s["wait_free_missed_target"] == 1 and s["no_time_to_target"] == 2 and s["wait_free_sooner"] == 1
    plot(points, summarize(points), tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0


def test_crossover_adaptive_against_the_better_protocol(tmp_path: Path) -> None:
    """Adaptive's ratio is to the better of the two protocols that reached the target, infinite when only
    adaptive missed it, and absent when no protocol reached it; the summary counts the points within 1.05
    and below both; the heterogeneous points give every client a value of its own."""
    from benchmarks.waitfree_crossover import adaptive_vs_best, heterogeneous, pre_upload_share, summarize

    assert adaptive_vs_best({"compute-and-wait": 20.0, "wait-free": 40.0, "adaptive": 21.0}) == 1.05
    assert adaptive_vs_best({"compute-and-wait": None, "wait-free": 40.0, "adaptive": 30.0}) == 0.75
    assert adaptive_vs_best({"compute-and-wait": 20.0, "wait-free": 40.0, "adaptive": None}) == math.inf
    assert adaptive_vs_best({"compute-and-wait": None, "wait-free": None, "adaptive": 9.0}) is None
    assert adaptive_vs_best({"compute-and-wait": 20.0, "wait-free": 40.0}) is None

    def pt(ratio: float | None) -> dict[str, Any]:
        return {"algorithm": "scd", "rate": "r", "x": 1.0, "p": 0.5, "zeta_ratio": 1.0, "adaptive_vs_best": ratio,
                "zeta_s": {"wait-free": 1.0, "compute-and-wait": 1.0, "adaptive": 1.0}}  # fmt: skip

    s = summarize([pt(0.9), pt(1.05), pt(1.2), pt(math.inf), pt(None)])["scd"]
    assert (s["adaptive_points"], s["adaptive_within_target"], s["adaptive_below_both"]) == (5, 2, 1)
    assert s["adaptive_worst_vs_best"] == math.inf and s["adaptive_all_wait_free"] == 0

    def ev(phase: str, start: float, end: float | None = None) -> dict[str, Any]:
        return {"phase": phase, "start_s": start, "end_s": start if end is None else end}

    # client a: round 1 wait-free (upload right after its decision), round 2 two PM steps first; b: none decided
    a = [ev("decide", 1), ev("upload", 1, 2), ev("pm_train", 1.5, 3), ev("decide", 4), ev("pm_train", 4, 5),
         ev("upload", 5, 6)]  # fmt: skip
    assert pre_upload_share({"a": {"events": a}, "b": {"events": [ev("gm_train", 0, 1)]}}) == 0.5
    assert pre_upload_share({"b": {"events": []}}) is None
    links, slow = heterogeneous(6).values()
    assert links == ("2mbit,5mbit,20mbit,100mbit,2mbit,5mbit", ())
    assert slow == ("20mbit", ("slowdown=1,1,2,4,1,1",))


def test_crossover_by_rate_compares_the_means_over_repetitions() -> None:
    """Per rate, each protocol's time to the target is the mean over the repetitions (None where one of them
    missed it) and adaptive's ratio is its mean over the better mean, the runs' own ratios beside it."""
    from benchmarks.waitfree_crossover import by_rate, rep_order, summarize

    three = ("compute-and-wait", "wait-free", "adaptive")
    assert rep_order(three, 1) == three and rep_order(three, 3) == three
    assert rep_order(three, 2) == ("compute-and-wait", "adaptive", "wait-free")
    assert rep_order(three[:2], 2) == three[:2]

    def pt(rate: str, cw: float | None, wf: float | None, ad: float | None, ratio: float | None) -> dict[str, Any]:
        return {"algorithm": "scd", "rate": rate, "x": 1.0, "p": 0.5, "zeta_ratio": None, "adaptive_vs_best": ratio,
                "zeta_s": {"compute-and-wait": cw, "wait-free": wf, "adaptive": ad}}  # fmt: skip

    # 2mbit: wait-free 20 and 12 (mean 16), adaptive 13 and 19 (mean 16): per run 1.08 once, the means 1.0
    points = [pt("2mbit", 70.0, 20.0, 13.0, 0.65), pt("2mbit", 72.0, 12.0, 19.0, 1.5833),
              pt("100mbit", 30.0, None, 20.0, 0.6667), pt("100mbit", 34.0, 40.0, 24.0, 0.7059),
              pt("1gbit", 30.0, 50.0, 20.0, 0.6667), pt("1gbit", 30.0, 50.0, None, math.inf)]  # fmt: skip
    rows = by_rate(points, "scd")
    assert [r["rate"] for r in rows] == ["2mbit", "100mbit", "1gbit"] and {r["reps"] for r in rows} == {2}
    assert rows[0]["zeta_mean_s"] == {"compute-and-wait": 71.0, "wait-free": 16.0, "adaptive": 16.0}
    assert rows[0]["adaptive_vs_best"] == 1.0 and rows[0]["adaptive_vs_best_runs"] == [0.65, 1.5833]
    # wait-free missed the target once: no mean of it, compute-and-wait's mean (32) is the better
    assert rows[1]["zeta_mean_s"]["wait-free"] is None and rows[1]["adaptive_vs_best"] == 0.6875
    assert rows[2]["adaptive_vs_best"] == math.inf  # adaptive alone missed it once
    s = summarize(points)["scd"]
    assert s["by_rate"] == rows and s["adaptive_mean_within_target"] == 2
    assert s["adaptive_mean_worst_vs_best"] == math.inf and s["adaptive_within_target"] == 4
    assert {r["gm_cpu_per_step_spread"] for r in rows} == {None}  # the points give no CPU seconds a GM step
    points[0]["gm_cpu_per_step_s"] = {"compute-and-wait": 0.03, "wait-free": 0.024, "adaptive": None}
    points[1]["gm_cpu_per_step_s"] = {"compute-and-wait": 0.027}
    assert by_rate(points, "scd")[0]["gm_cpu_per_step_spread"] == 1.25


def test_committed_crossover_series_agrees_with_its_points() -> None:
    """The committed crossover series: its summary is what its points give, each point's ``x`` and ratio are
    what its bench's ``protocols.json`` gives, and the re-run of two of its points lies on the same side of
    1 as the series' points at the same rate."""
    from benchmarks.waitfree_crossover import by_rate, point, summarize

    base = REPO / "benchmarks" / "results" / "protocols"
    series = json.loads((base / "crossover" / "crossover.json").read_text())
    hetero = len(series["heterogeneous"]) * series["heterogeneous_reps"] * len(series["heterogeneous_algorithms"])
    assert not series["failed"] and len(series["points"]) == 2 * len(series["rates"]) * series["reps"] + hetero
    for pt in series["points"]:
        again = point(base / "crossover" / pt["algorithm"] / pt["rate"] / f"rep{pt['rep']}")
        assert {k: pt[k] for k in again} == again, (pt["algorithm"], pt["rate"], pt["rep"])
    assert summarize(series["points"]) == series["summary"]
    # the check (crossover-check/): each series' points and summary are what its benches give; adaptive's mean time
    # to the target lies within 1.05 of the better protocol's mean at SCD's two points (3 repetitions), at Ditto's
    # 100 Mbit/s (3) and at Ditto's 20 Mbit/s over all 16 of its repetitions (3 + 7 in one order, 6 alternating)
    check = {}
    for f in sorted((base / "crossover-check").glob("*/crossover.json")):
        doc = json.loads(f.read_text())
        assert not doc["failed"], f
        for pt in doc["points"]:
            again = point(f.parent / pt["algorithm"] / pt["rate"] / f"rep{pt['rep']}")
            assert {k: pt[k] for k in again} == again, (f.parent.name, pt["rate"], pt["rep"])
        assert summarize(doc["points"]) == doc["summary"], f
        check[f.parent.name] = doc
    assert sorted(check) == ["ditto", "ditto-20mbit", "ditto-20mbit-alt", "hetero", "scd"]
    assert {p["order"][1] for p in check["ditto-20mbit-alt"]["points"]} == {"wait-free", "adaptive"}
    means = {(r["rate"], alg): r for alg in ("scd", "ditto") for r in check[alg]["summary"][alg]["by_rate"]}
    pooled = check["ditto-20mbit"]["points"] + check["ditto-20mbit-alt"]["points"]
    (means["20mbit", "ditto-16"],) = by_rate(pooled, "ditto")
    assert means["20mbit", "ditto-16"]["reps"] == 16
    for key in [("2mbit", "scd"), ("100mbit", "scd"), ("100mbit", "ditto"), ("20mbit", "ditto-16")]:
        assert means[key]["adaptive_vs_best"] <= 1.05, (key, means[key])
    hetero = {pt["rate"]: pt for pt in check["hetero"]["points"]}
    assert hetero["hetero-slowdown"]["adaptive_vs_best"] < 1, hetero["hetero-slowdown"]
    rerun = json.loads((base / "crossover-rerun" / "crossover.json").read_text())
    assert len(rerun["points"]) == 2
    for r in rerun["points"]:
        same = [pt for pt in series["points"] if (pt["algorithm"], pt["rate"]) == (r["algorithm"], r["rate"])]
        sides = {pt["zeta_ratio"] is not None and pt["zeta_ratio"] < 1 for pt in same}
        assert sides == {r["zeta_ratio"] is not None and r["zeta_ratio"] < 1} or len(sides) > 1, (r["rate"], sides)
        xs = [pt["x"] for pt in same]
        assert 0.8 * min(xs) <= r["x"] <= 1.25 * max(xs), (r["rate"], r["x"], xs)

"""Experiments as users run them: a sweep interrupted and resumed, its table against a hand
computation from the run folders, refusals, and TensorBoard files read back by TensorBoard."""

import json
import math
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from wafl.cli.report.table import TableError, build, find_runs, markdown
from wafl.cli.sim.simulate import simulate
from wafl.common.config import ConfigError, load_config

SWEEP = """
out = "{out}"
[base]
num_clients = 3
rounds = 2
[grid]
algorithm = ["fedavg", "fedprox"]
seed = [0, 1, 2]
"""


def _wafl(*args: str) -> list[str]:
    return [sys.executable, "-m", "wafl.cli.main", *args]


def test_sweep_interrupted_resumed_and_tabulated(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = tmp_path / "s.toml"
    spec.write_text(SWEEP.format(out=out))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(_wafl("sweep", str(spec)), env=env, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 240
    while len(list(out.glob("*/point.json"))) < 2:
        assert first.poll() is None and time.monotonic() < deadline, "the sweep ended before it could be interrupted"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # interrupted: some points done, one maybe half-written
    first.wait()
    done = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("*/point.json")}
    assert 2 <= len(done) < 6
    skipped: list[Path] = []
    partial = find_runs([out], on_skip=lambda folder, why: skipped.append(folder))
    assert sorted(r.path.name for r in partial) == sorted(done)  # the killed point is left out, not tabulated
    assert all(f.name not in done for f in skipped)
    second = subprocess.run(_wafl("sweep", str(spec)), env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert f"{6 - len(done)} to run, {len(done)} already done" in second.stderr
    after = {p.parent.name: p.stat().st_mtime_ns for p in out.glob("*/point.json")}
    assert len(after) == 6 and all(after[n] == t for n, t in done.items())  # finished points were not rerun

    # the table against a hand computation from the run folders
    doc = build(find_runs([out]), target=0.3, baseline="fedavg")
    assert set(doc["rows"]) == {"fedavg", "fedprox mu=0.01"}
    for name, algo in (("fedavg", "fedavg"), ("fedprox mu=0.01", "fedprox")):
        finals = []
        for seed in range(3):
            lines = (out / f"algorithm={algo},seed={seed}" / "results.jsonl").read_text().splitlines()
            rows = [json.loads(x) for x in lines]
            finals.append(rows[-1]["gm_accuracy"])
        mean = sum(finals) / 3
        std = math.sqrt(sum((f - mean) ** 2 for f in finals) / 3)
        got = doc["rows"][name]["final_gm"]
        assert got["mean"] == pytest.approx(mean) and got["std"] == pytest.approx(std)
        assert (got["min"], got["max"]) == (min(finals), max(finals))
        assert doc["rows"][name]["seeds"] == [0, 1, 2]
    diff = doc["differences"]["fedprox mu=0.01"]["final_gm"]
    assert diff["mean"] == pytest.approx(
        doc["rows"]["fedprox mu=0.01"]["final_gm"]["mean"] - doc["rows"]["fedavg"]["final_gm"]["mean"]
    )
    text = markdown(doc)
    assert "| fedavg | 3 |" in text and "Paired differences to fedavg" in text
    assert "final local acc. (%)" in text and "final PM acc. (%)" not in text  # FedAvg, FedProx: no PM
    assert doc["rows"]["fedavg"]["final_local"]["mean"] > 0.0
    table = subprocess.run(_wafl("table", str(out), "--json", str(tmp_path / "t.json")), capture_output=True, text=True)
    assert table.returncode == 0 and "| fedprox mu=0.01 | 3 |" in table.stdout
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["rows"]["fedavg"]["seeds"] == [0, 1, 2]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    assert saved["commits"] == [head.stdout.strip()]  # each point records the commit it ran on


def test_table_refuses_runs_of_different_settings(tmp_path: Path) -> None:
    for name, rounds in (("a", 1), ("b", 2)):
        simulate(load_config(None, {"num_clients": 2, "rounds": rounds}), tmp_path / name)
    with pytest.raises(TableError, match=r"differ in more than algorithm, params, seed: rounds: 1, 2"):
        build(find_runs([tmp_path]))
    r = subprocess.run(_wafl("table", str(tmp_path)), capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("wafl: the runs differ") and "Traceback" not in r.stderr
    by_rounds = subprocess.run(_wafl("table", str(tmp_path), "--by", "rounds"), capture_output=True, text=True)
    assert by_rounds.returncode == 0 and "MB moved" in by_rounds.stdout
    only = subprocess.run(
        _wafl("table", str(tmp_path), "--by", "rounds", "--metrics", "final_gm"), capture_output=True, text=True
    )
    assert only.returncode == 0 and only.stdout.splitlines()[0] == "| run | seeds | final GM acc. (%) |"
    bad = subprocess.run(_wafl("table", str(tmp_path), "--metrics", "accuracy"), capture_output=True, text=True)
    assert bad.returncode == 2 and "--metrics: unknown accuracy" in bad.stderr and "Traceback" not in bad.stderr


def test_sweep_file_mistakes_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    for text, message in (
        ("[grid]\nseed = 3\n", "grid.seed must be a non-empty list"),
        ("[grid]\nrounds = [0]\n", "rounds=0 must be an integer >= 1"),
        ("[gird]\n", "unknown section(s) ['gird']"),
    ):
        bad.write_text(text)
        r = subprocess.run(_wafl("sweep", str(bad)), capture_output=True, text=True)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_sweep_first_runs_the_matching_points_before_the_others(tmp_path: Path) -> None:
    """--first GLOB: the matching points run first, each group in the file's order (one job: they finish in
    the order they start); a pattern that matches no point is refused before anything runs."""
    from wafl.cli.experiments.sweep import first_order, load_sweep

    sweep = tmp_path / "s.toml"
    sweep.write_text(SWEEP.format(out=tmp_path / "out").replace("rounds = 2", "rounds = 1"))
    points = load_sweep(sweep)[1]
    names = [n for n, _ in points]
    order = [n for n, _ in first_order(points, ["*seed=2", "algorithm=fedprox,seed=0"])]
    assert order[:3] == ["algorithm=fedavg,seed=2", "algorithm=fedprox,seed=0", "algorithm=fedprox,seed=2"]
    assert sorted(order) == sorted(names) and order[3:] == [n for n in names if n not in order[:3]]
    assert [n for n, _ in first_order(points, [])] == names

    r = subprocess.run(_wafl("sweep", str(sweep), "--first", "*seed=9"), capture_output=True, text=True)
    assert r.returncode == 2 and "--first '*seed=9' matches no point" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    two = tmp_path / "two.toml"
    two.write_text(SWEEP.format(out=tmp_path / "out").replace("rounds = 2", "rounds = 1").replace("[0, 1, 2]", "[0]"))
    r = subprocess.run(_wafl("sweep", str(two), "--first", "algorithm=fedprox*"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    finished = [line.split("] ")[1].split(" (")[0] for line in r.stderr.splitlines() if line.endswith(" s)")]
    assert finished == ["algorithm=fedprox", "algorithm=fedavg"]


def test_a_finished_point_of_another_configuration_is_refused_by_name(tmp_path: Path) -> None:
    """A sweep file (or a default) changed after some points finished: the sweep does not skip them as done,
    nor run over them; it names them and the changed field, and leaves every folder as it was."""
    from wafl.cli.experiments.sweep import config_changes

    sweep = tmp_path / "s.toml"
    text = SWEEP.format(out=tmp_path / "out").replace("rounds = 2", "rounds = 1").replace("[0, 1, 2]", "[0]")
    sweep.write_text(text)
    r = subprocess.run(_wafl("sweep", str(sweep)), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    before = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    sweep.write_text(text.replace("[base]\n", "[base]\ngrad_clip = 10.0\n"))
    r = subprocess.run(_wafl("sweep", str(sweep)), capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "2 finished point(s)" in r.stderr and "algorithm=fedavg (grad_clip: 0.0 -> 10.0)" in r.stderr
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == before
    # a field the finished point lacks holds its default; params compare key by key, without defaults
    assert config_changes({"lr": 0.1}, {"lr": 0.1, "grad_clip": 0.0}) == []
    assert config_changes({"params": {"mu": 1}}, {"params": {"mu": 1, "clip": 1.1}}) == ["params.clip: '(none)' -> 1.1"]
    # unless the algorithm declares the value its runs had before the parameter existed (param(before=...))
    old = {"algorithm": "fedspeed", "params": {"lambda": 10.0}}
    assert config_changes(old, {"algorithm": "fedspeed", "params": {"lambda": 10.0, "dual_mean": "participants"}}) == []
    assert config_changes(old, {"algorithm": "fedspeed", "params": {"lambda": 10.0, "dual_mean": "all"}}) == [
        "params.dual_mean: 'participants' -> 'all'"
    ]


def test_tensorboard_files_read_back_by_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, {"num_clients": 2, "rounds": 3, "algorithm": "ditto", "tensorboard": str(tmp_path / "tb")})
    rows = simulate(cfg, tmp_path / "run")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    gm = acc.Scalars("gm_accuracy")
    assert [e.step for e in gm] == [1, 2, 3]
    assert [e.value for e in gm] == pytest.approx([r["gm_accuracy"] for r in rows])
    assert {"pm_accuracy", "train_loss", "bytes_up", "round_s"} <= set(tags)
    assert {"timeline/client-0/gm_train", "timeline/client-1/pm_train"} <= set(tags)
    hparams = acc.PluginTagToContent("hparams")  # the run's configuration, for TensorBoard's HParams view
    assert "_hparams_/session_start_info" in hparams and b"ditto" in hparams["_hparams_/session_start_info"]


def test_learning_check_sweep_files_load(repo: Path) -> None:
    from wafl.cli.experiments.sweep import load_sweep

    files = sorted((repo / "configs" / "sweeps").glob("*.toml"))
    assert {f.stem for f in files} >= {"fedhkd_digits", "asd_digits", "asd_digits_uniform", "scd_digits"}
    from wafl.common.datasets import DATASETS

    for f in files:
        spec = tomllib.loads(f.read_text())
        while "dataset" not in spec.get("base", {}) and "extends" in spec:  # a longer run of another sweep
            spec = tomllib.loads((f.parent / spec["extends"]).read_text())
        dataset = spec["base"].get("dataset")
        if dataset not in DATASETS:  # a sweep for a dataset this checkout does not have yet: refused by name
            with pytest.raises(ConfigError, match=f"dataset={dataset!r} is not one of"):
                load_sweep(f)
            continue
        out, points = load_sweep(f)
        assert out == Path(f"runs/sweep-{f.stem}")
        seeds = {c.federation.seed for _, c in points}
        if f.stem.endswith(("_flatness", "_dissimilarity", "_sensitivity")):  # analysis sweeps: fewer seeds
            assert len(seeds) >= (2 if f.stem.endswith("_flatness") else 1)
            flatness = f.stem.endswith("_flatness")
            assert all(c.output.checkpoint for _, c in points) or not flatness  # flatness reads them
            continue
        if f.stem.endswith("_tuning"):  # tuning runs a seed apart from the evaluation seeds
            assert {c.federation.seed for _, c in points}.isdisjoint({0, 1, 2})
            continue
        seeds = {c.federation.seed for _, c in points}
        assert seeds in ({0, 1, 2}, {0, 1}) and len(points) % len(seeds) == 0  # 3 seeds where they fit, never < 2


def test_fashion_mnist_sweep_files_hold_the_papers_settings(repo: Path) -> None:
    from wafl.cli.experiments.sweep import load_sweep

    def load(name: str) -> list:
        return [c for _, c in load_sweep(repo / "configs" / "sweeps" / f"{name}.toml")[1]]

    files = {name: load(name) for name in ("scd_fmnist", "fedhkd_fmnist", "asd_fmnist", "asd_fmnist_500")}
    for name, points in files.items():
        for c in points:
            # LeNet-5 exactly
            assert (c.data.dataset, c.training.model, c.training.code_len) == ("fashion-mnist", "lenet5", 84), name
            # no round closes short on a busy machine: deterministic points
            assert c.federation.round_deadline_s >= 3600
    scd = files["scd_fmnist"]
    assert {(c.federation.num_clients, c.data.partition, c.data.alpha, c.federation.fraction) for c in scd} == {
        (100, "dirichlet", 0.1, 1.0)
    }
    assert {c.training.algorithm for c in scd} == {
        "scd",
        "ditto",
        "fedrep",
        "fedrod",
        "fedbabu",
        "pfedme",
        "fedavg",
        "fedprox",
        "feddyn",
        "fedgen",
        "fedavgm",
    }
    ablation = {
        (c.training.params["lambda_g"] > 0, c.training.params["lambda_p"] > 0, c.client.protocol)
        for c in scd
        if c.training.algorithm == "scd"
    }
    assert ablation == {
        (True, True, "compute-and-wait"),
        (True, False, "compute-and-wait"),
        (False, True, "compute-and-wait"),
        (False, False, "compute-and-wait"),
        (True, True, "wait-free"),
    }
    # wait-free: until the broadcast
    assert all(c.client.pm_max_epochs == 1 and c.client.pm_min_steps == 0 for c in scd)
    hkd = files["fedhkd_fmnist"]
    assert {c.federation.num_clients for c in hkd} == {10, 20, 50}
    assert {(c.data.partition, c.data.delta, c.data.client_size) for c in hkd} == {("dirichlet-equal", 0.5, 1024)}
    fedhkd = {(c.training.params["gamma"], c.training.params["sigma"]) for c in hkd if c.training.algorithm == "fedhkd"}
    assert fedhkd == {(0.05, 7.0), (0.0, 7.0), (0.05, 0.0), (0.0, 0.0)}
    assert {c.training.algorithm for c in hkd} == {
        "fedhkd",
        "fedavg",
        "fedprox",
        "moon",
        "fedproto-avg",
        "fedgen",
        "fedmd",
        "fedalign",
    }
    bases = {"fedavg", "fedprox", "feddyn", "fedntd", "fedspeed", "fedsam", "scaffold"}
    for name, clients, fraction in (("asd_fmnist", 100, 0.1), ("asd_fmnist_500", 500, 0.01)):
        points = files[name]
        assert {(c.federation.num_clients, c.data.partition, c.data.delta, c.federation.fraction) for c in points} == {
            (clients, "dirichlet-equal", 0.3, fraction)
        }
        rows = {(c.training.algorithm, c.training.params.get("asd_uniform")) for c in points}
        assert rows == {(b, None) for b in bases} | {(f"{b}+asd", u) for b in bases for u in (False, True)}


def test_fashion_mnist_analysis_sweeps_run_the_comparison_tables_settings(repo: Path) -> None:
    """The flatness, G_d and sensitivity sweeps run on their paper's comparison table's setting: their
    points are that table's points (flatness, the G_d sweep's lambda 2, SCD at its default weights)
    but for what they measure, so their accuracies are the table's and the runs check each other."""

    from wafl.cli.experiments.sweep import load_sweep

    def load(name: str) -> dict[str, Any]:
        return dict(load_sweep(repo / "configs" / "sweeps" / f"{name}.toml")[1])

    asd, scd = load("asd_fmnist"), load("scd_fmnist")
    flat = load("asd_fmnist_flatness")
    assert {c.training.algorithm for c in flat.values()} == {
        f"{b}{a}" for b in ("fedavg", "feddyn", "fedspeed") for a in ("", "+asd")
    }
    for name, c in flat.items():
        assert c.output.checkpoint and {**c.to_dict(), "checkpoint": False} == asd[name].to_dict(), name
    gd = load("asd_fmnist_dissimilarity")
    assert sorted({c.training.params["asd_lambda"] for c in gd.values()}) == [0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0]
    for c in gd.values():
        assert c.evaluation.grad_dissimilarity_every == 1
        same = {**c.to_dict(), "grad_dissimilarity_every": 0, "params": {**c.training.params, "asd_lambda": 2.0}}
        seed = c.federation.seed
        assert (
            same == asd[f"algorithm=fedavg+asd,params.asd_lambda=2.0,params.asd_temperature=2.0,seed={seed}"].to_dict()
        )
    sens = load("scd_fmnist_sensitivity")
    default = {"tau": 0.4, "lambda_p": 0.4, "lambda_g": 0.3}
    scd_point = "algorithm=scd,params.lambda_g=0.3,params.lambda_p=0.4,params.spectrum=model,params.tau=0.4,seed=0"
    for c in sens.values():
        moved = [k for k in default if c.training.params[k] != default[k]]
        assert len(moved) <= 1  # one knob at a time
        assert {**c.to_dict(), "params": {**c.training.params, **default}} == scd[scd_point].to_dict()
    assert sorted(
        c.training.params["tau"]
        for c in sens.values()
        if c.training.params["lambda_p"] == 0.4 and c.training.params["lambda_g"] == 0.3
    ) == [0.1, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_sweep_point_params_table_and_dotted_keys_merge(tmp_path: Path) -> None:
    from wafl.cli.experiments.sweep import load_sweep

    spec = tmp_path / "p.toml"
    spec.write_text(
        '[base]\nnum_clients = 3\nrounds = 1\n[[points]]\nalgorithm = "fedprox"\nparams = { mu = 0.5 }\n'
        '[[points]]\nalgorithm = "ditto"\n"params.mu" = 0.25\n'
    )
    _, points = load_sweep(spec)
    assert [(c.training.algorithm, c.training.params) for _, c in points] == [
        ("fedprox", {"mu": 0.5}),
        ("ditto", {"mu": 0.25}),
    ]
    spec.write_text('[[points]]\nalgorithm = "fedprox"\nparams = 3\n')
    with pytest.raises(ConfigError, match="params must be a table"):
        load_sweep(spec)


def test_a_sweep_file_extends_another(tmp_path: Path) -> None:
    """``extends``: the other file's base, grid and points, this file's base fields over them, its grid lists
    and points in their place, its own out; a loop or a missing file is one line naming it."""
    from wafl.cli.experiments.sweep import load_sweep

    (tmp_path / "short.toml").write_text(
        'out = "runs/short"\n[base]\nnum_clients = 3\nrounds = 15\nparams = { mu = 0.5 }\n'
        "[grid]\nseed = [0, 1]\n"
        '[[points]]\nalgorithm = "fedprox"\n[[points]]\nalgorithm = "ditto"\n'
    )
    long = tmp_path / "long.toml"
    long.write_text('extends = "short.toml"\n[base]\nrounds = 300\nparams = { mu = 0.1 }\n[grid]\nseed = [0, 1, 2]\n')
    out, points = load_sweep(long)
    assert out == Path("runs/sweep-long")
    assert [n for n, _ in points] == [f"algorithm={a},seed={s}" for a in ("fedprox", "ditto") for s in (0, 1, 2)]
    assert {(c.federation.rounds, c.federation.num_clients) for _, c in points} == {(300, 3)}
    assert {c.training.params["mu"] for _, c in points} == {0.1}
    long.write_text('extends = "long.toml"\n')
    with pytest.raises(ConfigError, match="makes a loop"):
        load_sweep(long)
    long.write_text('extends = "gone.toml"\n')
    with pytest.raises(ConfigError, match="gone.toml.*does not exist"):
        load_sweep(long)


def test_params_for_gives_an_algorithms_points_their_parameters(tmp_path: Path) -> None:
    """``[params_for.<base>]``: parameters for every point whose algorithm has that base (composed ones too),
    over ``[base]``'s params and under a point's own, merged through ``extends``, not in the folder names."""
    from wafl.cli.experiments.sweep import load_sweep

    (tmp_path / "short.toml").write_text(
        "[base]\nnum_clients = 3\nrounds = 2\n[grid]\nseed = [0]\n"
        '[[points]]\nalgorithm = "fedavg"\n[[points]]\nalgorithm = "fedspeed"\n'
        '[[points]]\nalgorithm = "fedspeed+asd"\n"params.asd_lambda" = 2.0\n'
        '[[points]]\nalgorithm = "fedspeed"\n"params.rho" = 0.1\n"params.lambda" = 5.0\n'
        "[params_for.fedspeed]\nlambda = 20.0\n"
    )
    long = tmp_path / "long.toml"
    long.write_text('extends = "short.toml"\n[params_for.fedspeed]\ndual_mean = "all"\n')
    _, points = load_sweep(long)
    assert [n for n, _ in points] == [
        "algorithm=fedavg",
        "algorithm=fedspeed",
        "algorithm=fedspeed+asd,params.asd_lambda=2.0",
        "algorithm=fedspeed,params.lambda=5.0,params.rho=0.1",
    ]
    params = [c.training.params for _, c in points]
    assert "dual_mean" not in params[0]
    assert [(p["dual_mean"], p["lambda"]) for p in params[1:]] == [("all", 20.0), ("all", 20.0), ("all", 5.0)]
    long.write_text('extends = "short.toml"\nparams_for = { fedspeed = 1 }\n')
    with pytest.raises(ConfigError, match="params_for must hold one table of parameters per algorithm"):
        load_sweep(long)
    long.write_text('extends = "short.toml"\n[params_for.fedspeed]\ndual_mean = "some"\n')
    with pytest.raises(ConfigError, match="dual_mean"):
        load_sweep(long)


def test_table_reads_a_missing_config_field_as_its_default(tmp_path: Path) -> None:
    """A run recorded before a configuration field existed compares as if it held the default."""
    for name, seed in (("old", 0), ("new", 1)):
        simulate(load_config(None, {"num_clients": 2, "rounds": 1, "seed": seed}), tmp_path / name)
    old = tmp_path / "old" / "config.json"
    config = json.loads(old.read_text())
    del config["broadcast_all"]  # a field added after this run was recorded
    old.write_text(json.dumps(config))
    assert build(find_runs([tmp_path]))["rows"]["fedavg"]["seeds"] == [0, 1]
    config["broadcast_all"] = True  # not the default: a different setting
    old.write_text(json.dumps(config))
    with pytest.raises(TableError, match="broadcast_all: false, true"):
        build(find_runs([tmp_path]))


def test_table_epsilon_column_is_the_last_rounds_epsilon() -> None:
    from wafl.cli.report.table import Run, run_metrics

    rows = [
        {"round": 1, "wall_s": 1.0, "gm_accuracy": 0.2, "epsilon": 0.44},
        {"round": 2, "wall_s": 2.0, "epsilon": 0.63},
    ]
    assert run_metrics(Run(Path("a"), {"rounds": 2}, rows), 0.9)["epsilon"] == 0.63
    plain = [{"round": 1, "wall_s": 1.0, "gm_accuracy": 0.2}]
    assert run_metrics(Run(Path("b"), {"rounds": 1}, plain), 0.9)["epsilon"] is None  # no noise: no column value
    doc = build([Run(Path("c"), {"algorithm": "fedhkd", "seed": 0, "rounds": 2}, rows)])
    assert markdown(doc).splitlines()[0].endswith("| DP epsilon |") and "0.63 ± 0.00" in markdown(doc)


def test_table_new_client_columns_only_for_runs_with_new_clients() -> None:
    from wafl.cli.report.table import Run

    def run(seed: int, new: list[float | None]) -> Run:
        rows = [
            {"round": i + 1, "wall_s": float(i + 1), "gm_accuracy": 0.5, "new_client_accuracy": v}
            for i, v in enumerate(new)
        ]
        return Run(Path(f"r{seed}"), {"algorithm": "fedavg", "seed": seed, "rounds": len(new)}, rows)

    doc = build([run(0, [0.3, None, 0.6]), run(1, [0.5, 0.7, 0.4])])  # a round that was not evaluated: None
    final, best = doc["rows"]["fedavg"]["final_new"], doc["rows"]["fedavg"]["best_new"]
    assert (final["mean"], final["min"], final["max"]) == pytest.approx((0.5, 0.4, 0.6))
    assert (best["mean"], best["min"], best["max"]) == pytest.approx((0.65, 0.6, 0.7))
    assert "| final new-client acc. (%) | best new-client acc. (%) |" in markdown(doc).splitlines()[0]
    plain = build([Run(Path("p"), {"algorithm": "fedavg", "seed": 0, "rounds": 1}, [{"round": 1, "wall_s": 1.0}])])
    assert "final_new" not in plain["rows"]["fedavg"]  # tables of runs without new clients keep their shape


def test_a_client_that_fails_ends_the_simulation_with_its_error(tmp_path, monkeypatch) -> None:
    """In process, a client whose training raises stops the run at once with that error and the client's
    name, instead of the server waiting for its upload until the round deadline (here an hour)."""
    from wafl.client.trainer import Trainer

    real = Trainer.train_gm

    def train_gm(self):
        if self.index == 1:
            raise RuntimeError("training broke")
        return real(self)

    monkeypatch.setattr(Trainer, "train_gm", train_gm)
    cfg = load_config(None, {"num_clients": 3, "rounds": 2, "round_deadline_s": 3600.0})
    with pytest.raises(RuntimeError, match="training broke") as err:
        simulate(cfg, tmp_path / "run")
    assert "in the simulation's client client-1" in err.value.__notes__


def test_simulations_in_one_process_leave_no_fold_threads(tmp_path) -> None:
    """A sweep process runs point after point: each simulation's fold workers end with it."""
    import threading

    def folds() -> int:
        return sum(t.name.startswith("wafl-fold") for t in threading.enumerate())

    before = folds()
    for name in ("a", "b"):
        simulate(load_config(None, {"num_clients": 2, "rounds": 1}), tmp_path / name)
    deadline = time.monotonic() + 10
    while folds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert folds() == before


def test_sweep_points_compute_with_avx2_kernels_unless_told(tmp_path: Path, monkeypatch) -> None:
    """On x86-64 a sweep's points run torch's AVX2 kernels (their bits the same on machines with and without
    AVX-512), as their point.json records; a kernel set named in the environment is kept; the sweep leaves
    the caller's environment as it found it."""
    import platform

    import torch
    from wafl.cli.experiments.sweep import sweep

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("MKL_CBWR", raising=False)
    own = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    want = "AVX2" if x86 and own in ("AVX2", "AVX512") else own
    spec = tmp_path / "s.toml"
    spec.write_text("[base]\nnum_clients = 2\nrounds = 1\nround_deadline_s = 3600.0\ncheckpoint = false\n")
    assert sweep(spec, jobs=1, out=tmp_path / "a", show_progress=False) == 0
    point = json.loads((tmp_path / "a" / "point" / "point.json").read_text())
    assert point["cpu_capability"] == want
    if x86:
        assert point["kernels"] == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert not {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR"} & set(os.environ)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert sweep(spec, jobs=1, out=tmp_path / "b", show_progress=False) == 0
    assert json.loads((tmp_path / "b" / "point" / "point.json").read_text())["cpu_capability"] == "DEFAULT"
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default"

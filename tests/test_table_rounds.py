"""``wafl table``'s verdicts that use the rounds, on small synthetic run folders: the mean over the last 10
evaluated rounds, the paired differences' 95 % interval over seeds with both verdicts, and how the runs
stopped under the plateau rule; each against a slow re-computation from its formula."""

import json
import math
import random
import statistics
from pathlib import Path

import pytest
from wafl.cli.report.table import LAST, TableError, build, find_runs, markdown, t975

# t_{0.975, n-1} from a printed table (e.g. NIST/SEMATECH e-Handbook, 1.3.6.7.2), independent of table.py's
PRINTED_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 20: 2.086, 30: 2.042}


def write_run(root: Path, algorithm: str, seed: int, rows: list[dict], rounds: int, point: dict | None = None) -> None:
    folder = root / f"algorithm={algorithm},seed={seed}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"algorithm": algorithm, "seed": seed, "rounds": rounds}))
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "point.json").write_text(json.dumps(point or {"ok": True}) + "\n")


def curve(rng: random.Random, rounds: int, eval_every: int) -> list[dict]:
    """Rows with GM, PM and local accuracies on the evaluated rounds (every eval_every-th, the last 20, the
    last), None elsewhere, as an eval_every run with the plateau rule writes them."""
    rows = []
    for r in range(1, rounds + 1):
        on = r % eval_every == 0 or r > rounds - 20 or r == rounds
        rows.append(
            {
                "round": r,
                "wall_s": float(r),
                "round_s": 1.0,
                **{k: round(rng.uniform(0.3, 0.9), 6) if on else None for k in ("gm_accuracy", "pm_accuracy")},
                "local_accuracy": round(rng.uniform(0.3, 0.9), 6)
                if on and r % 2
                else None,  # some evaluated rows lack it
            }
        )
    return rows


def slow_mean_last(rows: list[dict], key: str, last: int) -> float | None:
    evaluated = [r[key] for r in rows if r.get(key) is not None]
    if not evaluated:
        return None
    chosen = evaluated[len(evaluated) - last :] if len(evaluated) > last else evaluated
    total = 0.0
    for v in chosen:
        total += v
    return total / len(chosen)


def test_mean_of_the_last_evaluated_rounds_matches_a_slow_recomputation(tmp_path: Path) -> None:
    rng = random.Random(3)
    runs = {seed: curve(rng, 40 - 11 * seed, rng.randint(1, 7)) for seed in range(3)}
    for seed, rows in runs.items():
        if len(rows) < 40:
            rows[-1]["stop_reason"] = "plateau"  # stopped early: a finished run all the same
        write_run(tmp_path, "fedavg", seed, rows, rounds=40)
    for last in (LAST, 3):
        doc = build(find_runs([tmp_path]), last=last)
        row = doc["rows"]["fedavg"]
        for metric, key in (("mean_last_gm", "gm_accuracy"), ("mean_last_pm", "pm_accuracy")):
            per_seed = [slow_mean_last(runs[s], key, last) for s in range(3)]
            mean = sum(per_seed) / 3
            assert row[metric]["mean"] == pytest.approx(mean, abs=1e-12)
            assert (row[metric]["min"], row[metric]["max"]) == pytest.approx((min(per_seed), max(per_seed)))
        local = [slow_mean_last(runs[s], "local_accuracy", last) for s in range(3)]
        assert row["mean_last_local"]["mean"] == pytest.approx(sum(local) / 3, abs=1e-12)
    text = markdown(build(find_runs([tmp_path])))
    head = text.splitlines()[0]
    # the new column beside the best one; the current columns stay as they were
    assert "| final GM acc. (%) | best GM acc. (%) | GM acc., mean of last 10 (%) | final PM acc. (%) |" in head


def test_t_quantiles() -> None:
    for df, t in PRINTED_T975.items():
        assert t975(df) == pytest.approx(t, abs=6e-4)
    assert t975(31) < t975(30) and t975(10_000) == pytest.approx(1.960201, abs=1e-6)
    with pytest.raises(ValueError):
        t975(0)
    # the slow re-computation: the root of the t distribution's CDF at 0.975, from the regularized
    # incomplete beta function (mpmath ships with torch's sympy), F(t) = 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2
    import mpmath

    def slow_t975(df: int) -> float:
        cdf = lambda t: 1 - mpmath.betainc(df / 2, 0.5, 0, df / (df + t * t), regularized=True) / 2  # noqa: E731
        return float(mpmath.findroot(lambda t: cdf(t) - 0.975, 2.0 if df > 2 else 5.0))

    for df in [*range(1, 41), 50, 60, 80, 100, 120, 200, 399]:
        assert t975(df) == pytest.approx(slow_t975(df), abs=1e-6)


def slow_verdicts(diffs: list[float]) -> tuple[list[float] | None, str, str]:
    """The 95 % interval mean +- t * s / sqrt(n) (s: statistics.stdev, n - 1) and both verdicts, written out."""
    n = len(diffs)
    seeds = "better" if n > 1 and min(diffs) > 0 else "worse" if n > 1 and max(diffs) < 0 else "inconclusive"
    if n < 2:
        return None, seeds, "inconclusive"
    m = statistics.fmean(diffs)
    half = PRINTED_T975[n - 1] * statistics.stdev(diffs) / math.sqrt(n)
    lo, hi = m - half, m + half
    return [lo, hi], seeds, "better" if lo > 0 else "worse" if hi < 0 else "inconclusive"


# per method: the last GM accuracy of seeds 0, 1, 2 (the baseline's are 0.50, 0.60, 0.70)
CASES = {
    "above": ([0.52, 0.62, 0.72], "better", "better"),  # +2 points on every seed: an interval of width 0
    "barely": ([0.501, 0.70, 0.71], "better", "inconclusive"),  # above on every seed, spread too wide
    "below": ([0.45, 0.56, 0.64], "worse", "worse"),
    "mixed": ([0.55, 0.58, 0.71], "inconclusive", "inconclusive"),
}
BASE = [0.50, 0.60, 0.70]


def test_paired_differences_get_a_95_percent_interval_and_two_verdicts(tmp_path: Path) -> None:
    for seed, acc in enumerate(BASE):
        write_run(tmp_path, "base", seed, [{"round": 1, "wall_s": 1.0, "gm_accuracy": acc}], rounds=1)
    for name, (accs, _, _) in CASES.items():
        for seed, acc in enumerate(accs):
            write_run(tmp_path, name, seed, [{"round": 1, "wall_s": 1.0, "gm_accuracy": acc}], rounds=1)
    write_run(tmp_path, "single", 0, [{"round": 1, "wall_s": 1.0, "gm_accuracy": 0.9}], rounds=1)
    doc = build(find_runs([tmp_path]), baseline="base")
    for name, (accs, seeds_rule, interval_rule) in CASES.items():
        diffs = [a - b for a, b in zip(accs, BASE)]
        ci, want_seeds, want_interval = slow_verdicts(diffs)
        assert (want_seeds, want_interval) == (seeds_rule, interval_rule)  # the cases are what they say
        for metric in ("final_gm", "mean_last_gm"):  # one row: its last round is its last 10
            d = doc["differences"][name][metric]
            assert d["ci95"] == pytest.approx(ci, abs=2e-3 * statistics.stdev(diffs) + 1e-12)
            assert (d["seeds_verdict"], d["interval_verdict"]) == (seeds_rule, interval_rule)
        assert "ci95" not in doc["differences"][name]["best_gm"]  # the best round is not judged
    single = doc["differences"]["single"]["final_gm"]
    assert single["ci95"] is None and (single["seeds_verdict"], single["interval_verdict"]) == ("inconclusive",) * 2
    text = markdown(doc)
    assert "| run | metric | seeds | difference | 95 % interval | seeds' rule | interval |" in text
    barely = [a - b for a, b in zip(CASES["barely"][0], BASE)]
    lo, hi = slow_verdicts(barely)[0]
    shown = f"{100 * statistics.fmean(barely):+.1f} ({100 * min(barely):+.1f} to {100 * max(barely):+.1f})"
    assert (
        f"| barely | final GM acc. | 3 | {shown} | [{100 * lo:+.1f}, {100 * hi:+.1f}] | better | inconclusive |" in text
    )
    assert "| above | GM acc., mean of last 10 | 3 | +2.0 (+2.0 to +2.0) | [+2.0, +2.0] | better | better |" in text
    assert "| single | final GM acc. | 1 | +40.0 (+40.0 to +40.0) | - | inconclusive | inconclusive |" in text


def test_the_stopped_column_counts_plateau_and_maximum(tmp_path: Path) -> None:
    """Runs with the plateau rule: one that stopped early is finished (not left out as short); the row says how
    many flattened and where, and how many reached the maximum without flattening. A short run without a
    plateau stop is still left out."""

    def rows(n: int, reason: str | None) -> list[dict]:
        out = [{"round": r, "wall_s": float(r), "gm_accuracy": 0.5} for r in range(1, n + 1)]
        if reason:
            out[-1]["stop_reason"] = reason
        return out

    write_run(tmp_path, "fedavg", 0, rows(30, "plateau"), rounds=50)
    write_run(tmp_path, "fedavg", 1, rows(41, "plateau"), rounds=50)
    write_run(tmp_path, "fedavg", 2, rows(50, "max_rounds"), rounds=50)
    write_run(tmp_path, "fedprox", 0, rows(50, "max_rounds"), rounds=50)
    write_run(tmp_path, "fedprox", 1, rows(20, None), rounds=50)  # interrupted: not a finished run
    skipped: list[Path] = []
    doc = build(find_runs([tmp_path], on_skip=lambda f, why: skipped.append(f)))
    assert [f.name for f in skipped] == ["algorithm=fedprox,seed=1"]
    assert doc["rows"]["fedavg"]["stopped"] == {"plateau": 2, "max_rounds": 1, "runs": 3, "plateau_rounds": [30, 41]}
    text = markdown(doc)
    assert text.splitlines()[0].startswith("| run | seeds | stopped | final GM acc. (%) |")
    assert "| fedavg | 3 | plateau 2/3 (rounds 30–41), max, not flat 1/3 |" in text
    assert "| fedprox | 1 | max, not flat 1/1 |" in text
    plain = tmp_path / "plain"
    write_run(plain, "fedavg", 0, rows(5, None), rounds=5)
    assert "stopped" not in markdown(build(find_runs([plain]))).splitlines()[0]  # runs without the rule


def test_within_pairs_each_row_with_the_baseline_at_its_own_client_count(tmp_path: Path) -> None:
    """``--within num_clients``: a row at 20 clients is paired with the baseline at 20 clients, never with
    the one at 10 (whose seeds ran other partitions); a count the baseline lacks gets no differences and is
    named; without ``--within`` the old pairing (one baseline row for all) is unchanged."""
    accs = {("base", 10): [0.50, 0.52, 0.51], ("base", 20): [0.70, 0.71, 0.69], ("m", 10): [0.55, 0.56, 0.54]}
    accs |= {("m", 20): [0.72, 0.74, 0.70], ("m", 50): [0.80, 0.81, 0.79]}
    for (algorithm, n), values in accs.items():
        for seed, acc in enumerate(values):
            folder = tmp_path / f"algorithm={algorithm},num_clients={n},seed={seed}"
            folder.mkdir(parents=True)
            config = {"algorithm": algorithm, "num_clients": n, "seed": seed, "rounds": 1}
            (folder / "config.json").write_text(json.dumps(config))
            (folder / "results.jsonl").write_text(json.dumps({"round": 1, "wall_s": 1.0, "gm_accuracy": acc}) + "\n")
    runs = find_runs([tmp_path])
    by = ("algorithm", "num_clients")
    doc = build(runs, by, baseline="base", within=("num_clients",))
    for n in (10, 20):
        want = [a - b for a, b in zip(accs[("m", n)], accs[("base", n)])]
        got = doc["differences"][f"m num_clients={n}"]["final_gm"]
        assert got["mean"] == pytest.approx(statistics.fmean(want)) and got["min"] == pytest.approx(min(want))
        assert doc["paired_with"][f"m num_clients={n}"] == f"base num_clients={n}"
    assert set(doc["differences"]) == {"m num_clients=10", "m num_clients=20"}
    assert doc["unpaired"] == ["m num_clients=50"] and doc["within"] == ["num_clients"]
    text = markdown(doc)
    assert "Paired differences to base at the same num_clients on the same seeds" in text
    assert "No baseline at the same num_clients yet, so no paired differences: m num_clients=50." in text
    # the old pairing: every row against the one baseline row named in full
    old = build(runs, by, baseline="base num_clients=10")
    assert old["paired_with"]["m num_clients=20"] == "base num_clients=10" and old["unpaired"] == []
    assert old["differences"]["m num_clients=20"]["final_gm"]["mean"] == pytest.approx(0.72 - 0.51)
    with pytest.raises(TableError, match="is not a row .without num_clients.; rows: .'base', 'm'."):
        build(runs, by, baseline="base num_clients=10", within=("num_clients",))
    with pytest.raises(TableError, match="--within seed: not among the fields that make the rows"):
        build(runs, by, baseline="base", within=("seed",))
    with pytest.raises(TableError, match="give --baseline too"):
        build(runs, by, within=("num_clients",))

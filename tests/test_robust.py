"""Bounded influence: update-norm clipping, coordinate-wise trimmed mean and median against numpy
re-computations, and a next model that is not finite never replacing the previous one."""

import math

import numpy as np
import pytest
import torch
from wafl.common.algorithms import registry
from wafl.common.codec import iter_chunks, manifest_of
from wafl.common.config import ConfigError, load_config
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.aggregation.rule import Rule
from wafl.server.strategies import check_aggregation, make_strategy


def make_state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(4, 3, 3, 3, generator=g) * scale,
        "fc.weight": torch.randn(60, 50, generator=g) * scale,  # several chunks at 4 KiB
        "fc.bias": (torch.randn(50, generator=g) * min(scale, 1e3)).to(torch.float16),  # float16 ends at 65504
        "bn.num_batches_tracked": torch.tensor(seed * 10, dtype=torch.int64),
    }


def fold(acc: Accumulator, state: dict[str, torch.Tensor], weight: float, commit: bool = True):
    specs = {s.name: s for s in acc.manifest}
    f = acc.begin(weight)
    for c in iter_chunks(state.items(), 4096):
        f.add(specs[c.name], c)
    if commit:
        f.commit()
    return f


def as_np(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.double().numpy() for k, v in state.items()}


def close(got: torch.Tensor, want: np.ndarray) -> None:
    if got.is_floating_point():
        tol = 2e-3 if got.dtype == torch.float16 else 1e-5
        np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got.numpy(), np.round(want).astype(np.int64))


def clipped(states, ref, bound):
    """Each state's floating-point update scaled to L2 norm <= bound (integers unchanged)."""
    out = []
    for st in states:
        x = as_np(st)
        floats = [k for k, v in st.items() if v.is_floating_point()]
        norm = math.sqrt(sum(float(((x[k] - ref[k]) ** 2).sum()) for k in floats))
        s = min(1.0, bound / norm)
        out.append({k: (ref[k] + s * (x[k] - ref[k])) if k in floats else x[k] for k in x})
    return out


def test_clipped_mean_matches_numpy() -> None:
    ref_state = make_state(100)
    states = [make_state(1), make_state(2, scale=50.0), make_state(3, scale=1e15)]  # the last two are clipped
    weights = [3.0, 5.0, 2.0]
    acc = Accumulator(manifest_of(ref_state), rule=Rule(clip_norm=4.0))
    acc.set_reference(ref_state)
    for st, w in zip(states, weights):
        fold(acc, st, w)
    ref = as_np(ref_state)
    want = clipped(states, ref, 4.0)
    got = acc.center()
    for k in ref:
        close(got[k], sum(w * x[k] for w, x in zip(weights, want)) / sum(weights))
    # no client moved the model by more than the bound: the mean's update is within it too
    floats = [k for k, v in ref_state.items() if v.is_floating_point()]
    moved = math.sqrt(sum(float(((got[k].double().numpy() - ref[k]) ** 2).sum()) for k in floats))
    assert moved <= 4.0 + 1e-3


def test_clipping_leaves_small_updates_and_rollbacks_exact() -> None:
    ref_state = make_state(100)
    small = {k: (v + 0.001).to(v.dtype) if v.is_floating_point() else v for k, v in ref_state.items()}
    acc = Accumulator(manifest_of(ref_state), rule=Rule(clip_norm=100.0))
    acc.set_reference(ref_state)
    fold(acc, make_state(7, scale=1e4), 1.0, commit=False).rollback()  # never counts
    fold(acc, small, 1.0)
    assert (acc.count, acc.total_weight) == (1, 1.0)  # the rolled-back upload left no trace
    got = acc.center()
    for k, v in as_np(small).items():
        close(got[k], v)


@pytest.mark.parametrize("center", ["median", "trimmed_mean"])
def test_robust_centers_match_numpy(center: str) -> None:
    states = [make_state(s) for s in range(5)] + [make_state(9, scale=1e8)]  # one poisoned upload
    acc = Accumulator(manifest_of(states[0]), rule=Rule(center=center, trim=0.2))
    for i, st in enumerate(states):
        fold(acc, st, float(i + 1))  # weights play no part in these centers
    got = acc.center()
    for k in states[0]:
        stack = np.stack([as_np(st)[k] for st in states])
        if center == "median":
            want = np.median(stack, axis=0)
        else:
            cut = math.floor(0.2 * len(states))  # 1 of 6 dropped at each end of every coordinate
            want = np.sort(stack, axis=0)[cut : len(states) - cut].mean(axis=0)
        close(got[k], want)
        if got[k].is_floating_point():
            assert float(got[k].abs().max()) < 100  # the poisoned values never reach the result
    acc.reset()  # the kept uploads are released; the accumulator serves the next round
    fold(acc, states[0], 1.0)
    for k, v in as_np(states[0]).items():
        close(acc.center()[k], v)


def test_trimmed_mean_with_clipping_matches_numpy() -> None:
    ref_state = make_state(100)
    states = [make_state(s, scale=1.0 + s) for s in range(4)]
    acc = Accumulator(manifest_of(ref_state), rule=Rule(center="trimmed_mean", trim=0.25, clip_norm=10.0))
    acc.set_reference(ref_state)
    for st in states:
        fold(acc, st, 1.0)
    want = clipped(states, as_np(ref_state), 10.0)
    assert acc.count == len(states)
    got = acc.center()
    for k in ref_state:
        stack = np.sort(np.stack([x[k] for x in want]), axis=0)
        close(got[k], stack[1:3].mean(axis=0))


def upload(s, cid: str, round: int, tensors, samples: int) -> None:
    t = s.open(cid, round, samples, f"{cid}-{round}", 0.0)
    fold(t.collection.accumulator, tensors, t.weight)
    s.commit(t, {"train_loss": 1.0}, None, 100, 0.0)


def test_a_non_finite_next_model_is_never_published() -> None:
    # FedDyn's server update w = mean - h/alpha overflows float32 for uploads near its largest value
    cfg = load_config(None, {"num_clients": 2, "algorithm": "feddyn", "params": {"alpha": 0.01}})
    prev = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    algo = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
    s = make_strategy(cfg, algo, 10, lambda: Accumulator(manifest_of(prev)))
    s.join("a", 0, 10)
    s.join("b", 1, 10)
    s.start(0.0)
    huge = {k: torch.full_like(v, 3.0e38) for k, v in prev.items()}
    upload(s, "a", 1, huge, 10)
    upload(s, "b", 1, huge, 10)
    state, knowledge, row = s.aggregate(prev, s.close(1.0))
    assert state is None and knowledge is None
    assert row["refused"].startswith("non-finite next model")
    assert algo.server.state_dict()["h"] == {}  # the server state of the refused round was rolled back
    assert s.version == 2  # the round counts: version 2 is the previous model again


def test_robust_options_are_validated() -> None:
    cfg = load_config(None, {"aggregator": "median", "clip_norm": 2.5, "trim_fraction": 0.3})
    assert (cfg.security.aggregator, cfg.security.clip_norm, cfg.security.trim_fraction) == ("median", 2.5, 0.3)
    for bad, match in [
        ({"aggregator": "mode"}, "aggregator="),
        ({"trim_fraction": 0.5}, "trim_fraction="),
        ({"clip_norm": 0.0}, "clip_norm="),
        ({"clip_norm": float("inf")}, "clip_norm="),
    ]:
        with pytest.raises(ConfigError, match=match):
            check_aggregation(load_config(None, bad))


def test_a_registered_center_is_an_aggregator_and_centers_a_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """A robust center is one function in the registry: the configuration accepts its name (and lists it
    among the valid ones), its refusal runs at start, and the accumulator combines each tensor with it."""
    from wafl.server.aggregation import robust

    with pytest.raises(ConfigError, match=r"is not one of \['mean', 'trimmed_mean', 'median'\]"):
        check_aggregation(load_config(None, {"aggregator": "largest"}))
    refuse = lambda trim, uploads: "largest needs 4 uploads" if uploads < 4 else None
    monkeypatch.setattr(robust.ROBUST_CENTERS, "_things", dict(robust.ROBUST_CENTERS))  # this test's registration only
    robust.register("largest", refuse)(lambda v, trim: v.max(axis=0))
    assert robust.center_names() == ["mean", "trimmed_mean", "median", "largest"]
    with pytest.raises(ConfigError, match="largest needs 4 uploads"):
        check_aggregation(load_config(None, {"aggregator": "largest", "num_clients": 3}))
    check_aggregation(load_config(None, {"aggregator": "largest", "num_clients": 4}))
    states = [make_state(s) for s in range(3)]
    acc = Accumulator(manifest_of(states[0]), rule=Rule(center="largest"))
    for i, st in enumerate(states):
        fold(acc, st, float(i + 1))
    got = acc.center()
    for k in states[0]:
        close(got[k], np.stack([as_np(st)[k] for st in states]).max(axis=0))


def test_the_default_bound_clips_an_outlier_to_a_multiple_of_the_median() -> None:
    from wafl.server.aggregation.norm_bound import NormBound

    ref_state = make_state(100)
    ref = as_np(ref_state)
    honest = [{k: (v + make_state(s, 0.01)[k]).to(v.dtype) for k, v in ref_state.items()} for s in (1, 2)]
    poisoned = make_state(3, scale=1e12)  # finite, far beyond any honest update
    bound = NormBound(10.0)
    bound.record([2.0, 3.0, 4.0])
    assert bound.bound(123.0) == 30.0  # 10 x the median of the accepted norms, whatever the model's norm
    acc = Accumulator(manifest_of(ref_state), rule=Rule(adaptive=10.0))
    acc.set_reference(ref_state)
    acc.bound = bound.bound(123.0)
    weights = [1.0, 2.0, 3.0]
    for st, w in zip([*honest, poisoned], weights):
        fold(acc, st, w)
    want = clipped([*honest, poisoned], ref, 30.0)
    got = acc.center()
    for k in ref:
        close(got[k], sum(w * x[k] for w, x in zip(weights, want)) / sum(weights))
    assert acc.clipped == 1 and acc.norms[2] == pytest.approx(30.0)
    assert max(float(got[k].double().abs().max()) for k in ref if got[k].is_floating_point()) < 100


def test_updates_within_the_default_bound_fold_bit_identically() -> None:
    ref_state = make_state(100)
    states = [make_state(s) for s in range(4)]
    plain = Accumulator(manifest_of(ref_state))
    bounded = Accumulator(manifest_of(ref_state), rule=Rule(adaptive=10.0))
    bounded.set_reference(ref_state)
    bounded.bound = 1e9
    for i, st in enumerate(states):
        fold(plain, st, float(i + 1))
        fold(bounded, st, float(i + 1))
    a, b = plain.center(), bounded.center()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert bounded.clipped == 0 and len(bounded.norms) == 4


def test_the_first_rounds_bound_is_the_models_norm_and_history_is_a_window() -> None:
    from wafl.server.aggregation.norm_bound import NormBound

    b = NormBound(10.0, window=2)
    assert b.bound(7.5) == pytest.approx(7.5)  # 10 x 0.1 x the model's norm
    assert b.bound(0.0) is None  # a model of zeros gives no scale: only the float32 refusal holds
    for norms in ([1.0], [100.0, 100.0], [5.0]):
        b.record(norms)
    assert b.history == [[100.0, 100.0], [5.0]]
    assert b.bound(1.0) == 1000.0
    assert NormBound(0.0).bound(1.0) is None


@pytest.mark.parametrize("value", [1e30, 3e38])
def test_an_update_beyond_float32_is_refused(value: float) -> None:
    from wafl.common.codec import ChunkError
    from wafl.common.errors import Code

    ref_state = make_state(100)
    poisoned = {k: torch.full_like(v, value) if v.dtype == torch.float32 else v for k, v in ref_state.items()}
    for rule in (Rule(adaptive=10.0), Rule(clip_norm=1.0)):
        acc = Accumulator(manifest_of(ref_state), rule=rule)
        acc.set_reference(ref_state)
        with pytest.raises(ChunkError, match="L2 norm exceeds") as e:
            fold(acc, poisoned, 1.0)
        assert e.value.code == Code.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"num_clients": 3, "aggregator": "trimmed_mean"}, "trims floor(0.1 x 3) = 0"),
        ({"num_clients": 10, "min_clients": 4, "aggregator": "trimmed_mean", "trim_fraction": 0.2}, "x 4) = 0"),
        ({"num_clients": 2, "aggregator": "median"}, "median of 2 uploads"),
        ({"num_clients": 10, "fraction": 0.2, "aggregator": "median"}, "median of 2 uploads"),
        ({"num_clients": 4, "norm_bound": 0.5}, "norm_bound"),
    ],
)
def test_vacuous_robust_settings_are_refused_at_start(fields: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        check_aggregation(load_config(None, fields))
    # the same rules with enough uploads per round are accepted
    kept = {k: v for k, v in fields.items() if k in ("aggregator", "trim_fraction")}
    check_aggregation(load_config(None, {**kept, "num_clients": 10}))


def test_the_default_bound_leaves_extra_tensors_alone() -> None:
    """FedGen's extra tensors (generator, label counts, per-client head rows) are not an update of the
    model: the default bound measures and clips the model's tensors only, so an honest FedGen run
    builds the same models with the bound as without it (counted in, its label counts alone put the
    first round's uploads far beyond the bound and the GM fell from 0.69 to 0.27)."""
    from wafl.cli.sim.simulate import simulate
    from wafl.common.config import RunConfig

    def final(norm_bound: float) -> dict:
        cfg = RunConfig.from_mapping(
            dict(
                algorithm="fedgen", num_clients=4, rounds=2, seed=3, protocol="compute-and-wait", norm_bound=norm_bound
            )
        ).validate()
        return simulate(cfg)[-1]

    bounded, unbounded = final(10.0), final(0.0)
    assert bounded["gm_accuracy"] == unbounded["gm_accuracy"]
    assert bounded["gm_accuracy"] > 0.5  # chance is 0.1


NORM_SCRIPT = """
import numpy as np
from wafl.server.aggregation.norm_bound import sq_norm
d = np.random.default_rng(7).standard_normal({n})
print(sq_norm(d).hex())
"""


@pytest.mark.parametrize("n", [5_000, 10_000, 48_120, 262_144])
def test_the_update_norm_has_the_same_bits_whatever_the_blas_threads(n: int) -> None:
    """The clip norm's squared sum is the same float with one BLAS thread or four (NumPy's OpenBLAS
    splits a dot product of more than 10,000 values over its threads, in an order set by their
    count), and it is the sum of squares to float64 rounding; up to 10,000 values it is ``np.dot``."""
    import os
    import subprocess
    import sys

    from wafl.server.aggregation.norm_bound import sq_norm

    got = set()
    for threads in ("1", "4"):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
        out = subprocess.run(
            [sys.executable, "-c", NORM_SCRIPT.format(n=n)], env=env, capture_output=True, text=True, check=True
        )
        got.add(out.stdout.strip())
    assert len(got) == 1, got
    d = np.random.default_rng(7).standard_normal(n)
    value = float.fromhex(got.pop())
    assert value == sq_norm(d)
    assert math.isclose(value, math.fsum(d * d), rel_tol=1e-13)
    if n <= 10_000:
        assert value == float(np.dot(d, d))

"""FedNova (common/algorithms/fednova.py): the next global model against a slow, element-by-element
re-computation of Wang et al.'s normalized averaging, its step norm against torch's SGD, and what
it refuses. The weights see each upload's declared ``train_steps`` (ServerUpdate.weight)."""

import statistics

import pytest
import torch
from strategy_checks import IDS, SAMPLES, make, state, upload
from wafl.cli.sim.simulate import simulate
from wafl.common.algorithms import registry
from wafl.common.algorithms.fednova import step_norm
from wafl.common.codec import manifest_of
from wafl.common.config import ConfigError, load_config
from wafl.common.errors import Code, Refused
from wafl.server.aggregation.accumulator import Accumulator
from wafl.server.aggregation.rule import Rule
from wafl.server.strategies import check_aggregation, make_strategy

STEPS = {"a": 3, "b": 5, "c": 8}


def slow_fednova(x: dict, models: dict, norms: dict) -> dict:
    """x - tau_eff * sum_i p_i (x - x_i) / a_i, p_i = n_i / sum n, tau_eff = sum_i p_i a_i, one float at a time."""
    total = sum(SAMPLES[c] for c in models)
    p = {c: SAMPLES[c] / total for c in models}
    tau_eff = sum(p[c] * norms[c] for c in models)
    out = {}
    for k, t in x.items():
        flat = t.flatten().tolist()
        new = []
        for j, xj in enumerate(flat):
            d = sum(p[c] * (xj - models[c][k].flatten()[j].item()) / norms[c] for c in models)
            new.append(xj - tau_eff * d)
        out[k] = torch.tensor(new, dtype=torch.float64).reshape(t.shape)
    return out


def slow_norm(steps: int, rho: float) -> float:
    """||a||_1: gradient k of ``steps`` counts sum_{j=0}^{steps-k} rho^j times in heavy-ball SGD."""
    return sum(sum(rho**j for j in range(steps - k + 1)) for k in range(1, steps + 1))


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_next_model_is_the_normalized_average(momentum: float) -> None:
    s = make(algorithm="fednova", momentum=momentum)
    s.start(0.0)
    x = state(0)
    models = {c: state(i + 1) for i, c in enumerate(STEPS)}
    for c, m in models.items():
        upload(s, c, 1, m, metrics={"train_steps": float(STEPS[c])})
    new, _, row = s.aggregate(x, s.close(1.0))
    assert row["clients"] == 3
    want = slow_fednova(x, models, {c: slow_norm(t, momentum) for c, t in STEPS.items()})
    for k in x:
        assert torch.allclose(new[k].double(), want[k], atol=1e-5), k
    # not FedAvg: the sample-weighted mean differs whenever step counts differ
    fedavg = sum(SAMPLES[c] * models[c]["w"].double() for c in models) / sum(SAMPLES.values())
    assert not torch.allclose(new["w"].double(), fedavg, atol=1e-3)


def test_equal_steps_give_fedavg() -> None:
    s = make(algorithm="fednova", momentum=0.0)
    s.start(0.0)
    models = {c: state(i + 1) for i, c in enumerate(STEPS)}
    for c, m in models.items():
        upload(s, c, 1, m, metrics={"train_steps": 4.0})
    new, _, _ = s.aggregate(state(0), s.close(1.0))
    fedavg = sum(SAMPLES[c] * models[c]["w"].double() for c in models) / sum(SAMPLES.values())
    assert torch.allclose(new["w"].double(), fedavg, atol=1e-6)


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_step_norm_is_how_far_torch_sgd_moves_on_a_unit_gradient(rho: float) -> None:
    for steps in (1, 2, 7):
        w = torch.zeros(1, requires_grad=True)
        opt = torch.optim.SGD([w], lr=1.0, momentum=rho)
        for _ in range(steps):
            opt.zero_grad()
            w.sum().backward()  # gradient 1 at every step
            opt.step()
        assert -w.item() == pytest.approx(step_norm(steps, rho), rel=1e-6)
        assert step_norm(steps, rho) == pytest.approx(slow_norm(steps, rho), rel=1e-12)


def test_an_upload_without_steps_is_refused() -> None:
    s = make(algorithm="fednova")
    s.start(0.0)
    with pytest.raises(Refused, match="train_steps, which must be >= 1") as e:
        s.open("a", 1, SAMPLES["a"], "k", 0.0, {"train_loss": 1.0})
    assert e.value.code == Code.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optimizer": "adam"}, "optimizer='adam' must be 'sgd'"),
        ({"aggregation": "buffered"}, "fednova.*does not combine with aggregation='buffered'"),
    ],
)
def test_config_refuses(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check_aggregation(load_config(None, {"num_clients": 3, "algorithm": "fednova", **overrides}))


def test_a_center_its_rescaling_does_not_know_is_refused() -> None:
    """FedNova centers the step norms itself (``robust_center``): a robust center registered later is refused,
    not taken for the mean."""
    for known in ("mean", "median", "trimmed_mean"):
        registry.resolve("fednova", {}, {"aggregator": known})
    with pytest.raises(ValueError, match="algorithm='fednova' with aggregator='largest'"):
        registry.resolve("fednova", {}, {"aggregator": "largest"})


ISSUE_STEPS = {"a": 5, "b": 17, "c": 3}  # issue 50's case


def bn_state(seed: int) -> dict[str, torch.Tensor]:
    """A model with a normalization statistic beside its trained tensors."""
    g = torch.Generator().manual_seed(seed)
    return {**state(seed), "bn.running_mean": torch.rand(4, generator=g)}


def robust_strategy(x: dict, clip_norm: float | None = None, **overrides):
    """A sync strategy whose accumulators apply the configuration's robust center (as the engine's do),
    measured against the global model ``x``."""
    cfg = load_config(None, {"num_clients": 3, "algorithm": "fednova", **overrides})
    algo = registry.resolve(cfg.training.algorithm, cfg.training.params, cfg.to_dict())
    rule = Rule(cfg.security.aggregator, cfg.security.trim_fraction, clip_norm)

    def accumulator() -> Accumulator:
        acc = Accumulator(manifest_of(x), rule=rule)
        acc.set_reference(x)
        return acc

    s = make_strategy(cfg, algo, 10, accumulator)
    for i, cid in enumerate(IDS):
        s.join(cid, i, SAMPLES[cid])
    return s


def slow_center(values: list[float], center: str, trim: float) -> float:
    if center == "median":
        return statistics.median(values)
    v, cut = sorted(values), int(trim * len(values))
    return statistics.fmean(v[cut : len(v) - cut])


def slow_robust_fednova(x: dict, models: dict, norms: dict, center: str, trim: float) -> dict:
    """x - center_i(a_i) * center_i((x - x_i) / a_i) coordinate by coordinate on the trained tensors,
    center_i(x_i) on the statistics (the module docstring's robust formula), one float at a time."""
    tau = slow_center(list(norms.values()), center, trim)
    out = {}
    for k, t in x.items():
        flat, new = t.flatten().tolist(), []
        for j, xj in enumerate(flat):
            xs = {c: models[c][k].flatten()[j].item() for c in models}
            if k.endswith("running_mean"):
                new.append(slow_center(list(xs.values()), center, trim))
            else:
                new.append(xj - tau * slow_center([(xj - xs[c]) / norms[c] for c in models], center, trim))
        out[k] = torch.tensor(new, dtype=torch.float64).reshape(t.shape)
    return out


@pytest.mark.parametrize("momentum", [0.0, 0.5])
@pytest.mark.parametrize("center, trim", [("median", 0.1), ("trimmed_mean", 0.34)])
def test_a_robust_center_takes_the_normalized_updates(center: str, trim: float, momentum: float) -> None:
    """Under ``median``/``trimmed_mean`` the step is the robust center of the normalized updates ``d_i`` times
    that of the step norms ``a_i`` (issue 50: the rescaling ``tau_eff W`` on top of the robust center of the
    models moved the model several times too far with steps {5, 17, 3})."""
    x = bn_state(0)
    s = robust_strategy(x, aggregator=center, trim_fraction=trim, momentum=momentum)
    s.start(0.0)
    models = {c: bn_state(i + 1) for i, c in enumerate(ISSUE_STEPS)}
    for c, m in models.items():
        upload(s, c, 1, m, metrics={"train_steps": float(ISSUE_STEPS[c])})
    new, _, row = s.aggregate(x, s.close(1.0))
    assert row["clients"] == 3
    norms = {c: slow_norm(t, momentum) for c, t in ISSUE_STEPS.items()}
    want = slow_robust_fednova(x, models, norms, center, trim)
    for k in x:
        assert torch.allclose(new[k].double(), want[k], atol=1e-5), k


def test_a_robust_center_with_equal_steps_is_the_robust_center_of_the_models() -> None:
    x = bn_state(0)
    s = robust_strategy(x, aggregator="median")
    s.start(0.0)
    models = {c: bn_state(i + 1) for i, c in enumerate(IDS)}
    for c, m in models.items():
        upload(s, c, 1, m, metrics={"train_steps": 6.0})
    new, _, _ = s.aggregate(x, s.close(1.0))
    for k in x:
        median = torch.stack([m[k] for m in models.values()]).median(dim=0).values
        assert torch.allclose(new[k], median, atol=1e-6), k


def test_a_robust_center_normalizes_the_clipped_updates() -> None:
    """With ``clip_norm`` each update is clipped first, then divided by its ``a_i``."""
    x, bound = state(0), 0.5
    s = robust_strategy(x, clip_norm=bound, aggregator="median", momentum=0.0)
    s.start(0.0)
    models = {c: state(i + 1) for i, c in enumerate(ISSUE_STEPS)}
    for c, m in models.items():
        upload(s, c, 1, m, metrics={"train_steps": float(ISSUE_STEPS[c])})
    new, _, _ = s.aggregate(x, s.close(1.0))
    clipped = {}
    for c, m in models.items():
        norm = sum(float(((m[k] - x[k]).double() ** 2).sum()) for k in x) ** 0.5
        f = min(1.0, bound / norm)
        clipped[c] = {k: x[k].double() + f * (m[k].double() - x[k].double()) for k in x}
    want = slow_robust_fednova(x, clipped, {c: float(t) for c, t in ISSUE_STEPS.items()}, "median", 0.0)
    for k in x:
        assert torch.allclose(new[k].double(), want[k], atol=1e-5), k


def test_server_momentum_is_the_papers() -> None:
    """``v <- beta v + Delta``, ``x <- x - v`` with ``Delta = tau_eff sum_i p_i d_i`` over two rounds (the
    authors' ``gmf``), the velocity through a checkpoint; beta = 0 is plain FedNova."""
    beta = 0.7
    algo = registry.resolve("fednova", {"server_momentum": beta}, {"num_clients": 3})
    x = state(0)
    norms = {c: float(t) for c, t in STEPS.items()}
    v: dict | None = None
    for r in (1, 2):
        models = {c: state(10 * r + i) for i, c in enumerate(STEPS)}
        metrics = {c: {"train_steps": float(STEPS[c])} for c in STEPS}
        algo.server.collected([(SAMPLES[c], metrics[c]) for c in STEPS])
        w = {c: algo.server.weight(SAMPLES[c], metrics[c]) for c in STEPS}
        mean = {k: sum(w[c] * models[c][k].double() for c in STEPS) / sum(w.values()) for k in x}
        new = algo.server.finalize(x, {k: t.float() for k, t in mean.items()}, 3)
        plain = slow_fednova(x, models, norms)
        delta = {k: x[k].double() - plain[k] for k in x}
        v = delta if v is None else {k: beta * v[k] + delta[k] for k in x}
        want = {k: x[k].double() - v[k] for k in x}
        for k in x:
            assert torch.allclose(new[k].double(), want[k], atol=1e-5), (r, k)
        if r == 1:  # the velocity survives a restart
            state_dict = algo.server.state_dict()
            algo = registry.resolve("fednova", {"server_momentum": beta}, {"num_clients": 3})
            algo.server.load_state_dict(state_dict)
        x = new


def test_a_short_federation_learns(tmp_path) -> None:
    """The real client protocol declares its steps in every upload header; the server normalizes by them."""
    cfg = load_config(
        None,
        {"algorithm": "fednova", "num_clients": 3, "rounds": 3, "seed": 1, "protocol": "compute-and-wait"},
    )
    rows = simulate(cfg, tmp_path)
    assert [r["clients"] for r in rows] == [3, 3, 3]
    assert rows[-1]["gm_accuracy"] > 0.3  # ten classes: chance is 0.1

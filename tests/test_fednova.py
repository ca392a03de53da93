"""FedNova (common/algorithms/fednova.py): the next global model against a slow, element-by-element
re-computation of Wang et al.'s normalized averaging, its step norm against torch's SGD, and what
it refuses. The weights see each upload's declared ``train_steps`` (ServerUpdate.weight)."""

import pytest
import torch
from strategy_checks import SAMPLES, make, state, upload
from wafl.cli.simulate import simulate
from wafl.common.algorithms.fednova import step_norm
from wafl.common.config import ConfigError, load_config
from wafl.common.errors import Code, Refused

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
        load_config(None, {"num_clients": 3, "algorithm": "fednova", **overrides})


def test_a_short_federation_learns(tmp_path) -> None:
    """The real client protocol declares its steps in every upload header; the server normalizes by them."""
    cfg = load_config(
        None,
        {"algorithm": "fednova", "num_clients": 3, "rounds": 3, "seed": 1, "protocol": "compute-and-wait"},
    )
    rows = simulate(cfg, tmp_path)
    assert [r["clients"] for r in rows] == [3, 3, 3]
    assert rows[-1]["gm_accuracy"] > 0.3  # ten classes: chance is 0.1

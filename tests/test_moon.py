"""MOON: the model-contrastive term against a per-sample re-computation; the previous model persists."""

import math

import pytest
import torch
from algorithm_checks import client, global_payload
from wafl.common.algorithms.moon import STATE_KEY, moon_term
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_moon_term_matches_the_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    z, zg, zp = (torch.randn(5, 7, generator=gen) for _ in range(3))
    tau = 0.5
    total = 0.0
    for b in range(5):
        cos = lambda u, v: float(u @ v) / math.sqrt(float(u @ u) * float(v @ v))  # noqa: E731
        pos, neg = math.exp(cos(z[b], zg[b]) / tau), math.exp(cos(z[b], zp[b]) / tau)
        total += -math.log(pos / (pos + neg))
    assert moon_term(z, zg, zp, tau).item() == pytest.approx(total / 5, rel=1e-5)


def test_moon_keeps_the_previous_local_model_across_restarts(digits, tmp_path) -> None:
    t = client(digits, "moon", state_dir=tmp_path)
    t.begin_round(1, global_payload(t))
    t.train_gm()
    prev = t.client_state[STATE_KEY]
    assert all(torch.equal(prev[k], v) for k, v in t.gm.state_dict().items())
    again = client(digits, "moon", state_dir=tmp_path)
    assert all(torch.equal(again.client_state[STATE_KEY][k], v) for k, v in prev.items())
    # with mu = 0 the round is FedAvg's
    a, b = client(digits, "fedavg"), client(digits, "moon", {"mu": 0.0})
    for t in (a, b):
        t.begin_round(1, global_payload(t))
        t.train_gm()
    assert all(torch.equal(x, y) for x, y in zip(a.gm.parameters(), b.gm.parameters()))

"""FedSpeed: merged perturbed gradient, prox correction and dual variable, by hand (Algorithm 1)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from algorithm_checks import client, close, future_batches, global_payload
from wafl.common.algorithms.fedspeed import STATE_KEY
from wafl.common.datasets import load_dataset


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_fedspeed_round_by_hand(digits, tmp_path) -> None:
    lam, alpha, rho, lr = 2.0, 0.3, 0.1, 0.05
    t = client(digits, "fedspeed", {"lambda": lam, "alpha": alpha, "rho": rho}, state_dir=tmp_path)
    gen = torch.Generator().manual_seed(0)
    dual = [0.01 * torch.randn(p.shape, generator=gen) for p in t.gm.parameters()]
    t.client_state[STATE_KEY] = [d.clone() for d in dual]
    t.begin_round(1, global_payload(t))
    slow = copy.deepcopy(t.gm)
    ps = list(slow.parameters())
    x0 = [p.detach().clone() for p in ps]
    (batches,) = future_batches(t, 1)
    for xb, yb in batches:
        g1 = torch.autograd.grad(F.cross_entropy(slow(xb), yb), ps)
        norm = torch.sqrt(sum((g**2).sum() for g in g1))
        w = [p.detach().clone() for p in ps]
        with torch.no_grad():
            for p, g in zip(ps, g1):
                p.add_(rho * g / norm)
        g2 = torch.autograd.grad(F.cross_entropy(slow(xb), yb), ps)
        with torch.no_grad():
            for p, wi, a, b, d, x in zip(ps, w, g1, g2, dual, x0):
                p.copy_(wi - lr * ((1 - alpha) * a + alpha * b - d + (wi - x) / lam))
    new_dual = [d - (p.detach() - x) / lam for d, p, x in zip(dual, ps, x0)]
    upload = [p.detach() - lam * d for p, d in zip(ps, new_dual)]
    t.train_gm()
    assert close(list(t.gm.parameters()), upload, atol=1e-4)
    assert close(t.client_state[STATE_KEY], new_dual, atol=1e-5)
    again = client(digits, "fedspeed", {"lambda": lam, "alpha": alpha, "rho": rho}, state_dir=tmp_path)
    assert close(again.client_state[STATE_KEY], t.client_state[STATE_KEY], atol=0)
